"""The groups of ``make mutants`` (:mod:`mutants`): which modules each group
mutates, the tests it runs against them and its sample size, and the
functions a group draws from where it draws from some only. Data only, kept
apart from the harness so that each stays short; docs/testing.md has one
table row per group."""

from __future__ import annotations

#: name -> (modules, tests, sampled mutants)
GROUPS: dict[str, tuple[list[str], list[str], int]] = {
    "feedback": (["gradpress/exchange/feedback.py", "gradpress/exchange/keys.py"],
                 ["tests/test_references.py", "tests/test_config_fields.py", "tests/test_mutants_feedback.py",
                  "tests/test_mutants_presence.py", "tests/test_residual_owner.py", "tests/test_key_escape.py",
                  "tests/test_key_upgrade.py", "tests/test_plants_feedback.py"], 6),
    "engine": (["gradpress/exchange/engine.py", "gradpress/exchange/dispatch.py", "gradpress/exchange/base.py"],
               ["tests/test_references.py", "tests/test_accounting.py", "tests/test_config_fields.py",
                "tests/test_mutants_engine.py", "tests/test_key_escape.py"], 4),
    "strategies": ([f"gradpress/exchange/strategies/{m}.py" for m in ("allreduce", "allgather", "ring", "ps",
                                                                      "recompress", "rounds")],
                   ["tests/test_references.py", "tests/test_accounting.py", "tests/test_config_fields.py"], 6),
    "accounting": (["gradpress/transport/wire.py", "gradpress/transport/collectives.py",
                    "gradpress/transport/p2p.py", "gradpress/exchange/stats.py"],
                   ["tests/test_wire.py", "tests/test_accounting.py"], 4),
    "spec": (["gradpress/compress/spec.py", "gradpress/compress/registry.py"],
             ["tests/test_spec_registry.py", "tests/test_compressors.py", "tests/test_mutants_spec.py"], 30),
    "quantizers": ([f"gradpress/compress/{m}.py" for m in ("qsgd", "natural", "randomk", "terngrad", "dithering")],
                   ["tests/test_power.py", "tests/test_unbiased.py", "tests/test_plants_quantizers.py"], 30),
    "diloco": (["gradpress/algorithms/diloco.py"],
               ["tests/test_diloco_switch.py", "tests/test_diloco_keep_switch.py", "tests/test_diloco_residual_decay.py",
                "tests/test_algorithms_outer.py", "tests/test_references.py"], 10),
    "lsgd": ([f"gradpress/algorithms/{m}.py" for m in ("lsgd", "lsgd_election", "lsgd_pull")],
             ["tests/test_algorithms_lsgd.py", "tests/test_lsgd_average.py", "tests/test_scaler_load.py"], 10),
    "support": ([f"gradpress/exchange/strategies/{m}.py" for m in ("union", "cyclic", "support")],
                ["tests/test_union.py", "tests/test_cyclic.py"], 10),
    "streaming": (["gradpress/algorithms/streaming.py"], ["tests/test_streaming_buffers.py", "tests/test_algorithms_outer.py"], 8),
    "localsgd": (["gradpress/algorithms/localsgd.py"], ["tests/test_algorithms.py", "tests/test_references.py"], 6),
    "gossip": ([f"gradpress/algorithms/{m}.py" for m in ("sgp", "choco", "gossip", "gossip_codec")],
               ["tests/test_gossip.py", "tests/test_gossip_state.py", "tests/test_sgp_load_inflight.py"], 8),
    "adam": ([f"gradpress/algorithms/{m}.py" for m in ("onebit_adam", "zeroone_adam", "compressed_adam")],
             ["tests/test_compressed_adam.py"], 8),
    "comprex": ([f"gradpress/algorithms/{m}.py" for m in ("comprex", "comprex_lookahead", "comprex_optim",
                                                          "comprex_schedule")],
                ["tests/test_comprex_parts.py", "tests/test_comprex.py", "tests/test_accounting.py"], 10),
    "lgc": ([f"gradpress/algorithms/{m}.py" for m in ("lgc", "lgc_autoencoder", "lgc_exchange")],
            ["tests/test_lgc_autoencoder.py", "tests/test_lgc.py"], 8),
    "topology": ([f"gradpress/algorithms/{m}.py" for m in ("dpsgd", "topology")],
                 ["tests/test_topology.py", "tests/test_gossip.py", "tests/test_gossip_state.py"], 8),
    "hierarchical": ([f"gradpress/exchange/strategies/{m}.py" for m in ("hierarchical", "hierarchical_pipeline")],
                     ["tests/test_hierarchical.py"], 8),
    "kit": ([f"gradpress/compress/kit/{m}.py" for m in ("declare", "layout", "packing", "rng", "primitives",
                                                                    "reductions")],
            ["tests/test_kit_primitives.py", "tests/test_kit_rng.py", "tests/test_kit_authoring.py",
             "tests/test_wire.py", "tests/test_compressors.py", "tests/test_kit_identity.py",
             # the compiled reductions' std and the sign-byte pack (plants6: caught only here)
             "tests/test_kit_fused.py::test_std_is_the_exact_deviation",
             "tests/test_kit_fused.py::test_pack_signs_lays_out_the_bits"], 10),
    "sparsifiers": ([f"gradpress/compress/{m}.py" for m in ("topk", "sparse", "threshold", "dgc", "dgc_threshold", "sidco",
                                                           "_threshold_select", "gaussiank", "redsync")],
                    ["tests/test_sparse_kernels.py", "tests/test_compressors.py", "tests/test_estimators.py",
                     "tests/test_literature.py"], 12),
    "signs": ([f"gradpress/compress/{m}.py" for m in ("signs", "signsgd", "efsignsgd", "signum", "onebit", "minmax8",
                                                     "powersgd", "halfprec", "stosign")],
              ["tests/test_stosign.py", "tests/test_powersgd_exact.py", "tests/test_compressors.py",
               "tests/test_efsignsgd_chunk.py", "tests/test_compressor_traits.py", "tests/test_literature.py",
               "tests/test_kit_identity.py"], 12),
    "planner": ([f"gradpress/exchange/{m}.py" for m in ("planner", "plans", "costs", "pieces")],
                ["tests/test_plan.py", "tests/test_accounting.py", "tests/test_hierarchical.py"], 8),
    "hook": ([f"gradpress/ddp/{m}.py" for m in ("hook", "hook_binding", "hook_views", "comm_thread", "hook_state",
                                                "register", "ranks", "buckets", "loss_scale")],
             ["tests/test_mutants_buckets.py", "tests/test_plants_ddp.py", "tests/test_ddp.py", "tests/test_ddp_models.py",
              "tests/test_ddp_unused_warning.py", "tests/test_unused_edges.py", "tests/test_review_ampscale.py"], 12),
    "guards": ([f"gradpress/exchange/{m}.py" for m in ("agree", "nonfinite", "state", "state_check", "background")],
               ["tests/test_mutants_guards.py", "tests/test_load_refusals.py", "tests/test_exchange_hardening.py", "tests/test_config_fields.py",
                "tests/test_mutants_engine.py", "tests/test_comprex_parts.py",
                "tests/test_robustness.py::test_nonfinite_skip_drops_the_step_on_every_rank",
                "tests/test_review_ampsign.py", "tests/test_review_ampscale.py"], 8),
    "decode": ([f"gradpress/compress/{m}.py" for m in ("packet", "base", "signs", "signsgd", "signum", "halfprec",
                                                      "efsignsgd", "natural", "minmax8", "qsgd", "onebit", "terngrad",
                                                      "bits")]
               + ["gradpress/compress/kit/declare.py", "gradpress/compress/kit/primitives.py",
                  "gradpress/compress/kit/reductions.py",
                  "gradpress/exchange/base.py"],
               ["tests/test_decode_into.py", "tests/test_kit_primitives.py", "tests/test_mutants_decode.py",
                "tests/test_compressors.py"], 30),
    "state": (["gradpress/train/checkpoint.py", "gradpress/ddp/state_format.py", "gradpress/algorithms/base.py",
               "gradpress/train/optim.py", "gradpress/exchange/reshard.py", "gradpress/train/reshard.py",
               "gradpress/exchange/strategies/ps_reshard.py", "gradpress/exchange/strategies/hierarchical_reshard.py"],
              ["tests/test_mutants_state.py", "tests/test_torch_compat.py", "tests/test_review_resume.py",
               "tests/test_exchange_hardening.py::test_version_one_hook_state_loads",
               "tests/test_review_ddp_names.py",
               "tests/test_train_hardening.py::test_hook_state_dict_loads_with_weights_only",
               "tests/test_train_hardening.py::test_damaged_tensor_bytes_are_refused_on_load",
               "tests/test_train_hardening.py::test_bad_checkpoint_is_one_line_and_exit_2",
               "tests/test_train_hardening.py::test_malformed_load_state_dict_raises_value_error_and_changes_nothing",
               "tests/test_train.py", "tests/test_algorithms.py",
               # the reshard modules: the fold without workers, and one end-to-end 4 -> 2 resume (not the long ones)
               "tests/test_reshard.py", "tests/test_reshard_train.py::test_four_workers_resume_on_two",
               "tests/test_reshard_strategies.py", "tests/test_reshard_midepoch.py", "tests/test_reshard_load.py"], 24),
    "numerics": ([f"gradpress/compress/{m}.py" for m in ("numerics", "sampling", "_density")],
                 ["tests/test_mutants_numerics.py", "tests/test_efsignsgd_chunk.py", "tests/test_summand_bound.py",
                  "tests/test_extreme.py", "tests/test_estimators.py"], 20),
    "codecs": ([f"gradpress/compress/{m}.py" for m in ("adacomp", "compose", "fft", "rangefloat")]
               + ["gradpress/compress/kit/streams.py"],
               ["tests/test_mutants_codecs.py", "tests/test_compressors.py", "tests/test_compressor_traits.py",
                "tests/test_literature.py", "tests/test_kit_streams.py", "tests/test_extreme.py"], 20),
    "algobase": ([f"gradpress/algorithms/{m}.py" for m in ("base", "exchange_helpers", "loss_probe", "registry",
                                                            "presence", "restart", "alarm", "sync_guard",
                                                            "loss_scale")],
                 ["tests/test_mutants_algobase.py", "tests/test_mutants_presence.py", "tests/test_algorithms.py",
                  "tests/test_review_sync_skip.py", "tests/test_algorithms_lsgd.py", "tests/test_algorithms_models.py",
                  "tests/test_algorithms_models_lsgd_sgp_adam.py", "tests/test_review_adam_presence.py", "tests/test_algorithms_models2.py",
                  "tests/test_skip_restart.py", "tests/test_skip_keep_residual.py", "tests/test_sync_guard.py",
                  "tests/test_sync_keys.py", "tests/test_review_ampalgo.py", "tests/test_scaler_load.py"], 32),
    "compiler": (["gradpress/compress/kit/compiler.py", "gradpress/compress/spans.py", "gradpress/compress/params.py"],
                 ["tests/test_mutants_compiler.py", "tests/test_kit_compile.py", "tests/test_review_kit.py",
                  "tests/test_kit_fused.py::test_each_signature_compiles_apart_and_past_its_recompile_limit_only_new_"
                  "shapes_run_eagerly",
                  "tests/test_kit_fused.py::test_a_kernel_with_a_graph_break_falls_back_to_eager_with_a_warning",
                  "tests/test_kit_fused.py::test_whole_tensor_reductions_compile_on_cpu_only_under_auto",
                  "tests/test_kit_fused.py::test_a_number_handed_to_a_kernel_every_call_does_not_compile_a_variant_"
                  "per_value",
                  "tests/test_compressors.py", "tests/test_mutants_codecs.py"], 20),
    "layout": ([f"gradpress/exchange/strategies/{m}.py" for m in ("hierarchical_abort", "hierarchical_costs",
                                                                  "hierarchical_layout")]
               + ["gradpress/transport/groups.py", "gradpress/exchange/catalog.py", "gradpress/exchange/probe.py"],
               ["tests/test_mutants_layout.py", "tests/test_hierarchical_costs.py", "tests/test_plan.py",
                "tests/test_cli_strategies.py", "tests/test_review_groups.py",
                "tests/test_exchange_hardening.py::test_measurement_fits_the_slowest_rank_on_every_rank"], 24),
    "workloads": ([f"gradpress/workloads/{m}.py" for m in ("base", "mnist1d", "wide", "digits", "charlm", "userdata")],
                  ["tests/test_mutants_workloads.py", "tests/test_workloads.py", "tests/test_review_workloads.py",
                   "tests/test_train_hardening.py::test_truncated_cache_file_is_regenerated"], 15),
    "train": ([f"gradpress/train/{m}.py" for m in ("loop", "session", "evaluate", "algorithm", "report", "splits",
                                                    "precision")],
              ["tests/test_mutants_train.py", "tests/test_mutants_train_session.py", "tests/test_plants_train.py",
               "tests/test_splits.py", "tests/test_train_precision.py",
               "tests/test_tensorboard.py::test_a_resumed_run_purges_the_events_the_interrupted_run_wrote_past_its_"
               "checkpoint",
               "tests/test_train.py::test_data_order_is_sharded_and_deterministic",
               "tests/test_train.py::test_loop_drives_any_algorithm_through_the_interface",
               "tests/test_train.py::test_algorithms_command_lists_ddp_and_the_registry",
               "tests/test_train.py::test_a_registered_algorithm_is_validated_listed_and_trained",
               "tests/test_train.py::test_ddp_adapter_skips_the_optimizer_step_the_hook_dropped",
               "tests/test_train.py::test_each_workload_trains",
               "tests/test_review_resume.py::test_resume_keeps_the_step_the_loss_first_became_non_finite",
               "tests/test_review_resume.py::test_resume_keeps_the_metrics_lines_before_a_torn_last_line",
               "tests/test_train_hardening.py::test_divergence_writes_null_names_the_step_and_fails"], 15),
    "config": ([f"gradpress/train/{m}.py" for m in ("config", "validate", "checks", "args", "launch", "cpus", "flags")],
               ["tests/test_mutants_config.py", "tests/test_mutants_cpus.py", "tests/test_cgroup_cpus.py",
                "tests/test_usable_cpus.py", "tests/test_cli_flag_errors.py",
                "tests/test_train.py::test_bad_arguments_exit_2", "tests/test_train.py::test_bad_config_files",
                "tests/test_train.py::test_bad_data_files", "tests/test_train.py::test_resume_without_checkpoint",
                "tests/test_train.py::test_config_precedence",
                "tests/test_launch_port.py",
                "tests/test_launch_start.py::test_workers_are_never_forked_from_the_launcher",
                "tests/test_launch_start.py::test_a_worker_gets_the_launchers_environment_of_this_launch",
                "tests/test_preflight.py::test_refused_before_workers_start",
                "tests/test_preflight.py::test_world_size_checks_wait_for_a_known_world",
                "tests/test_preflight.py::test_defaults_pass",
                "tests/test_train_warnings.py::test_the_one_line_form",
                "tests/test_train_plan.py::test_plan_costs_are_checked_before_workers_start",
                "tests/test_train_hardening.py::test_bad_out_fails_before_any_worker_in_one_line",
                "tests/test_train_hardening.py::test_config_file_key_given_twice_in_two_spellings_is_refused",
                "tests/test_train_hardening.py::test_unwritable_tensorboard_dir_fails_before_any_worker",
                "tests/test_train_hardening.py::test_hierarchical_layout_that_cannot_divide_nproc_fails_before_any_"
                "worker",
                "tests/test_train_hardening.py::test_workload_options_the_workload_ignores_are_refused",
                "tests/test_train_hardening.py::test_bad_out_from_python_raises_value_error_naming_out",
                "tests/test_train_hardening.py::test_describe_failures_names_the_killed_worker_first",
                "tests/test_train_hardening.py::test_timeout_flag_is_validated_and_reaches_the_config",
                "tests/test_train_hardening.py::test_huge_seed_names_the_field",
                "tests/test_train_hardening.py::test_nproc_above_the_cap_is_refused_before_any_worker"], 26),
    "compare": (["gradpress/compare.py", "gradpress/compare_run.py", "gradpress/compare_report.py",
                 "gradpress/compare_resume.py"]
                + [f"gradpress/commands/{m}.py" for m in ("algorithms", "bench", "cluster", "compare", "compressors",
                                                          "strategies", "train")],
                ["tests/test_mutants_compare.py", "tests/test_review_compare_nan.py", "tests/test_cli_strategies.py",
                 "tests/test_compare_rank_clip.py"]
                + [f"tests/test_compare_resume.py::{t}" for t in (  # all but the real grid's (it trains)
                    "test_the_lr_sweep_is_read_back_and_other_settings_are_refused_by_name",
                    "test_a_finished_run_is_reused_only_for_the_same_compressor",
                    "test_a_summary_without_recorded_settings_is_refused_not_guessed",
                    "test_a_run_that_trains_again_first_drops_an_earlier_summary",
                    "test_non_finite_numbers_read_back_as_an_uninterrupted_compare_wrote_them")]
                + [f"tests/test_compare.py::{t}" for t in (
                    "test_split_specs", "test_split_specs_rejects",
                    "test_reference_prefers_ddp_none_and_labels_name_the_algorithm", "test_target_and_steps_to_target",
                    "test_compare_bad_spec_trains_nothing", "test_runs_are_the_cross_product_of_algorithms_and_compressors",
                    "test_seed_aggregate_reports_missed_targets", "test_parse_seeds", "test_parse_seeds_and_rates_reject",
                    "test_parse_seeds_refuses_out_of_range_and_huge_counts",
                    "test_a_parameter_after_a_spec_without_parameters_is_named", "test_best_lr_rule",
                    "test_lr_sweep_picks_each_methods_best_rate")]
                + [f"tests/test_review_compare_run.py::{t}" for t in (
                    "test_lr_sweep_never_picks_a_rate_whose_run_diverged",
                    "test_a_reused_directory_keeps_no_files_of_an_earlier_compare",
                    "test_a_failed_run_is_recorded_and_the_others_go_on",
                    "test_every_run_failed_writes_the_failures_and_exits_1",
                    "test_a_failed_sweep_run_counts_as_no_metric_and_fails_the_compare",
                    "test_ctrl_c_still_exits_130_keeping_the_finished_and_failed_runs",
                    "test_a_diverged_seed_counts_as_no_metric_in_the_target_and_the_aggregate",
                    "test_a_diverged_run_makes_compare_exit_3_as_train_does",
                    "test_out_and_resume_in_a_config_file", "test_a_strategy_in_a_config_file_is_honoured",
                    "test_an_out_that_cannot_be_written_is_refused_before_any_run",
                    "test_a_batch_the_data_cannot_fill_is_refused_before_any_run",
                    "test_algorithm_or_compressor_in_a_config_file_is_refused")]
                + ["tests/test_train.py::test_algorithms_command_lists_ddp_and_the_registry",
                   "tests/test_bench_compressors.py::test_bench_command_discovers_registrars",
                   "tests/test_readme.py::test_compressor_table_is_generated_from_registry",
                   "tests/test_cluster.py::test_help_says_no_delay_emulation",
                   "tests/test_cluster.py::test_cli_refuses_more_ranks_than_the_local_worker_cap"], 20),
    "integrations": (["gradpress/accelerate.py", "gradpress/lightning.py", "gradpress/tensorboard.py",
                      "gradpress/workloads/charlm_transformer.py"],
                     ["tests/test_mutants_integrations.py", "tests/test_review_accelerate_cpu.py",
                      "tests/test_tensorboard.py::test_stats_scalars_names_every_stat_and_drops_what_is_missing_or_not_"
                      "finite",
                      "tests/test_tensorboard.py::test_tensorboard_flag_fails_clearly_without_tensorboard",
                      "tests/test_tensorboard.py::test_a_resumed_run_purges_the_events_the_interrupted_run_wrote_past_"
                      "its_checkpoint",
                      "tests/test_workloads.py::test_charlm_transformer_builds_learns_and_is_causal",
                      "tests/test_integrations_lightning.py::test_callback_refuses_another_strategy_a_foreign_world_"
                      "size_and_warns_without_state",
                      "tests/test_integrations_imports.py"], 20),
    "bench": (["gradpress/compare_stats.py"]
              + [f"gradpress/bench/{m}.py" for m in ("specs", "e2e_args", "e2e_configs", "measure")],
              ["tests/test_mutants_bench.py", "tests/test_review_compare_nan.py", "tests/test_bench_compressors.py",
               "tests/test_compare_ci.py"]
              + [f"tests/test_compare.py::test_{t}" for t in (
                  "split_specs", "split_specs_rejects", "seed_aggregate_reports_missed_targets", "parse_seeds",
                  "parse_seeds_and_rates_reject", "parse_seeds_refuses_out_of_range_and_huge_counts", "best_lr_rule",
                  "lr_sweep_picks_each_methods_best_rate")]
              + [f"tests/test_bench_e2e.py::test_{t}" for t in (
                  "parse_configs_strategies_and_commas", "parse_configs_strategy_parameters",
                  "parse_configs_with_an_algorithm", "parse_baselines", "per_configuration_learning_rate",
                  "bad_config_spec_names_the_field", "malformed_lists_are_described_in_the_current_syntax",
                  "a_rate_after_a_spec_without_parameters_starts_a_new_configuration", "bad_baseline",
                  "cli_rejects_bad_arguments_before_building_a_cluster",
                  "cli_refuses_out_of_range_values_before_any_namespace",
                  "cli_refuses_an_out_it_cannot_create_before_any_namespace", "wire_factor_and_command_line",
                  "intra_bandwidth_needs_several_workers_per_node", "seeds_aggregate_time_to_target_and_count_misses",
                  "seeds_need_train_to", "a_parameter_after_an_option_is_refused_naming_both")], 20),
    "cluster": ([f"gradpress/cluster/{m}.py" for m in ("units", "links", "outcomes", "bulk", "host", "netns")],
                ["tests/test_mutants_cluster.py"] + [f"tests/test_cluster.py::test_{t}" for t in (
                    "parse_rate_like_tc", "parse_rate_rejects_with_field_and_forms",
                    "parse_rate_size_time_refuse_huge_exponents", "parse_size_and_time",
                    "constructor_validation_names_field", "worst_exit_code",
                    "workers_per_node_numbers_ranks_host_by_host")], 20),
    "benchreport": ([f"gradpress/bench/{m}.py" for m in ("e2e_rows", "e2e_report", "e2e_seeds", "compressors_rows",
                                                          "compressors_report", "estimators")],
                    [f"tests/test_mutants_benchreport{f}.py" for f in ("", "_compressors", "_estimators")]
                    + [f"tests/test_bench_e2e.py::test_{t}" for t in (
                        "wire_factor_and_command_line",
                        "ideal_payload_counts_each_partitions_bytes_at_the_factor_of_how_it_was_sent",
                        "seeds_aggregate_time_to_target_and_count_misses",
                        "payload_cell_names_the_bytes_that_stay_inside_a_host",
                        "the_target_line_says_which_way_the_metric_reaches_it")]
                    + ["tests/test_bench_e2e_overlap.py::test_bound_is_max_of_compute_plus_compression_and_wire",
                       "tests/test_bench_e2e_ci.py"]
                    + [f"tests/test_bench_compressors.py::test_{t}" for t in (
                        "small_run_writes_every_field_and_declared_wire_sizes", "matrix_methods_run_on_a_matrix_view",
                        "variants_put_kit_and_hand_written_side_by_side",
                        "the_report_says_when_decodes_pay_for_fresh_pages",
                        "fractions_use_the_better_roofline_before_or_after_the_rows")]
                    + [f"tests/test_estimators.py::test_bench_estimators_{t}" for t in ("rows_and_table", "command_line")],
                    20),
    "benchpure": ([f"gradpress/bench/{m}.py" for m in ("data", "plan", "strategies", "compressors_sweep", "e2e_jobs",
                                                        "args")],
                  ["tests/test_mutants_benchpure.py", "tests/test_mutants_benchpure_commands.py",
                   "tests/test_bench_compressors.py"]
                  + [f"tests/test_usable_cpus.py::test_{t}" for t in (
                      "bench_compressors_threads_bound_is_the_usable_cores",
                      "bench_e2e_threads_bound_and_default_are_the_usable_cores",
                      "bench_estimators_threads_bound_is_the_usable_cores",
                      "the_profile_script_refuses_bad_arguments_before_profiling")]
                  + [f"tests/test_exchange_hardening.py::test_bench_plan_{t}" for t in (
                      "refuses_an_out_it_cannot_write_before_workers", "refuses_nproc_above_the_cap_before_workers",
                      "refuses_cuda_without_cuda_before_workers", "reports_a_failed_worker_in_one_line")]
                  + [f"tests/test_bench_e2e.py::test_{t}" for t in (
                      "per_configuration_learning_rate", "cli_rejects_bad_arguments_before_building_a_cluster",
                      "cli_refuses_out_of_range_values_before_any_namespace")], 20),
    "e2e": ([f"gradpress/bench/{m}.py" for m in ("e2e_worker", "e2e_worker_setup", "e2e_worker_counts", "e2e_run",
                                                "e2e_profile", "e2e")],
            ["tests/test_mutants_e2e.py", "tests/test_mutants_e2e_run.py"]
            + [f"tests/test_bench_e2e.py::test_{t}" for t in (
                "payload_formulas", "interface_bytes_reads_this_namespace", "e2e_is_a_bench_subcommand",
                "seeds_need_train_to", "profile_phases_of_the_allgather_step", "wire_factor_and_command_line",
                "cli_rejects_bad_arguments_before_building_a_cluster",
                "cli_refuses_out_of_range_values_before_any_namespace",
                "cli_refuses_an_out_it_cannot_create_before_any_namespace",
                "worker_step_and_train_modes_on_two_local_workers")], 25),
    "plots": (["gradpress/bench/plot.py", "gradpress/bench/compressors.py", "gradpress/cluster/processes.py",
               "gradpress/demo.py"],
              ["tests/test_mutants_plots.py", "tests/test_mutants_plots_processes.py", "tests/test_bench_compressors.py",
               "tests/test_usable_cpus.py::test_bench_compressors_threads_bound_is_the_usable_cores",
               "tests/test_cluster.py::test_workers_per_node_numbers_ranks_host_by_host",
               "tests/test_train_hardening.py::test_nproc_above_the_cap_is_refused_before_any_worker"], 20),
    "compat": (["gradpress/torch_compat.py", "gradpress/train/cli.py", "gradpress/cli.py", "gradpress/workloads/__init__.py",
                "gradpress/cluster/selftest.py", "gradpress/compress/kit/__init__.py", "gradpress/compress/plugins.py"],
               ["tests/test_mutants_compat.py", "tests/test_mutants_plugins.py", "tests/test_torch_compat.py", "tests/test_cli_strategies.py",
                "tests/test_train.py::test_bad_arguments_exit_2"]
               + [f"tests/test_workloads.py::test_{t}" for t in (
                   "names_and_unknown", "budget_note_names_the_epochs_that_reach_the_tuned_schedule",
                   "train_prints_the_budget_note")]
               + [f"tests/test_kit_streams.py::test_pack_and_unpack_match_the_python_integer_stream[{b}-off]"
                  for b in (3, 12)]
               + ["tests/test_kit_declarations.py::test_kit_pack_checks_its_codes_under_kit_check"]
               + [f"tests/test_plugins.py::test_{t}" for t in (  # in process; the two launches are not run here
                   "compressors_and_algorithms_list_a_plugin", "the_environment_variable_loads_a_plugin_at_the_first_lookup",
                   "bench_compressors_measures_a_plugin", "a_plugin_that_cannot_be_loaded_is_refused_before_anything_runs",
                   "an_unknown_name_points_at_plugins")], 25),
}
#: where a group draws only from some functions of a module (its qualified names: ``Class.method``):
#: module -> functions; a module a group lists without an entry here is drawn from whole
FOCUS: dict[str, dict[str, list[str]]] = {
    "decode": {
        "gradpress/compress/packet.py": ["Packet", "Packet.nbytes", "Packet.numel", "Packet.aliases", "check_decode_out"],
        "gradpress/compress/signs.py": ["unpack_signs", "unpack_two", "decode_signs"],
        "gradpress/compress/base.py": ["Compressor.decode_into", "Compressor.residual"],
        "gradpress/compress/signsgd.py": ["SignSGD.decode_into"],
        "gradpress/compress/signum.py": ["Signum.decode_into"],
        "gradpress/compress/halfprec.py": ["_Cast.decode", "_Cast.decode_into"],
        "gradpress/compress/efsignsgd.py": ["EFSignSGD.decode_into", "EFSignSGD._decode"],
        "gradpress/compress/natural.py": ["_values", "_sign_words", "Natural.decode_fields"],
        "gradpress/compress/minmax8.py": ["MinMax8.decode_fields"],
        "gradpress/compress/qsgd.py": ["QSGD.decode_fields"],
        "gradpress/compress/onebit.py": ["OneBit.decode_fields"],
        "gradpress/compress/terngrad.py": ["TernGrad.decode_fields"],
        "gradpress/compress/bits.py": ["unpack_table"],
        "gradpress/compress/kit/declare.py": ["KitCompressor.__init_subclass__", "KitCompressor.decode_into"],
        "gradpress/compress/kit/primitives.py": ["elementwise", "_whole_and_tail"],
        "gradpress/compress/kit/reductions.py": ["_row_extremes", "_row_minmax"],
        "gradpress/exchange/base.py": ["aggregate_packets", "aggregate"],
    },
    "state": {  # the algorithm's configuration, state dict and stats (its exchange helpers: the algobase group)
        "gradpress/algorithms/base.py": ["Algorithm.spec", "Algorithm.config", "Algorithm.state_dict",
                                         "Algorithm.load_state_dict", "Algorithm.stats"],
    },
    "algobase": {  # the algorithm's exchange helpers (its configuration and state: the state group)
        "gradpress/algorithms/base.py": ["Algorithm.__init__", "Algorithm.exchanged_params"],
        "gradpress/algorithms/exchange_helpers.py": [
            "ExchangeHelpers.gradients", "ExchangeHelpers.local_step", "ExchangeHelpers._reset_last",
            "ExchangeHelpers.ddp_step", "ExchangeHelpers.sync", "ExchangeHelpers.average_plain",
            "ExchangeHelpers.broadcast_model", "ExchangeHelpers.consensus_model"],
    },
    "config": {  # the launcher's world and environment resolution, testable in one process (not init_group,
        # _worker_entry, _start_forkserver: they start a group or a process)
        "gradpress/train/launch.py": ["free_port", "_in_group_env", "run", "_launcher_environ", "_start_method",
                                      "launch_config", "describe_failures"],
    },
    "compare": {  # the ranking and its arguments (not plot: drawing; not cluster's run: it builds namespaces and
        # starts every rank)
        "gradpress/compare.py": ["split_specs", "_slug", "label", "_is_identity", "_reference", "_ref_runs", "final",
                                 "_mean_final", "target_for", "_reached", "annotate", "_fmt_bytes", "table",
                                 "_plan_runs", "run"],
        "gradpress/commands/cluster.py": ["register"],
    },
    "cluster": {  # the pure parts: the tbf arithmetic, the commands a layout runs, names, checks, a bulk receiver
        # on 127.0.0.1 (not start/close/teardown/processes: they build or delete namespaces); units.py and
        # outcomes.py are drawn whole
        "gradpress/cluster/links.py": ["default_burst", "LinksMixin._cmd", "LinksMixin._tbf", "LinksMixin._intra_tbf",
                                       "LinksMixin.queue_limit_bytes", "LinksMixin._build", "LinksMixin.link_stats"],
        "gradpress/cluster/host.py": ["_preflight", "_netns_list", "_pid_alive", "cleanup_stale", "_check_prefix"],
        "gradpress/cluster/netns.py": ["EmulatedCluster.__init__", "EmulatedCluster.namespaces",
                                       "EmulatedCluster.address", "EmulatedCluster.node_of",
                                       "EmulatedCluster._check_node"],
        "gradpress/cluster/bulk.py": ["receive"],
    },
    "benchreport": {  # the tables' figures (not plot: drawing; not run_seeds: it runs the benchmark on a cluster)
        "gradpress/bench/e2e_report.py": ["reach_sign", "_payload", "human_bytes", "lr_text", "_f", "markdown",
                                          "_background_table"],
        "gradpress/bench/e2e_seeds.py": ["_reached", "combine", "_rank_note", "_order", "table", "markdown", "bars",
                                         "caption"],
    },
    "benchpure": {  # the arguments, the figures and the command lines (not plan's _worker/measure_costs: a group
        # of workers; not strategies' run/_worker/_run_pair: they spawn the workers); data.py, compressors_sweep.py,
        # e2e_jobs.py (its cluster is an argument) and args.py are drawn whole
        "gradpress/bench/plan.py": ["register_bench", "main"],
        "gradpress/bench/strategies.py": ["build_model", "format_table", "main"],
    },
    "e2e": {  # the worker's figures (step timing, byte and link accounting, the train-to loop's stop and time),
        # the run's compute-only median, speed-ups and notes, the profile's phases, the command (not the worker's
        # thread, group and file plumbing, _set_threads/_setup/_finish/_write, nor the profile script's argument
        # parsing, which test_usable_cpus.py checks)
        "gradpress/bench/e2e_worker.py": ["run_compute", "run_step", "run_train", "run_train.after", "main"],
        "gradpress/bench/e2e_worker_setup.py": ["_batches", "_build_algorithm"],
        "gradpress/bench/e2e_worker_counts.py": ["interface_bytes", "payload_bytes_per_step", "step_counts"],
        "gradpress/bench/e2e_run.py": ["_compute", "run_e2e", "_parameters"],
        "gradpress/bench/e2e_profile.py": ["_median_s", "profile"],
        "gradpress/bench/e2e.py": ["register_bench", "_seeds", "main", "write_outputs"],
    },
    "compat": {  # selftest.py's training steps (not its ``__main__`` block, which only hands main's status to leave)
        "gradpress/cluster/selftest.py": ["main"],
    },
}
