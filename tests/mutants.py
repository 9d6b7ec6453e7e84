"""``make mutants``: sampled mutation testing of the core modules with cosmic-ray.

Never touches the working tree: the files git knows (tracked and untracked
but not ignored) are copied to a temporary directory, and cosmic-ray mutates
and restores files there. One cosmic-ray session per group of modules, each
run against the fast tests that cover it (marked ``mutants``): multi-process
tests cost tens of seconds per mutant on 2 cores, so each group draws a fixed
sample of its mutants (seeded: the same sample on every run of the same
code) and marks the rest skipped. Writes a markdown report (score per module
and the diff of every survivor) to ``--report``.

Usage: python tests/mutants.py [--report FILE] [--scale X] [--group NAME ...]
``--scale`` multiplies every sample size (0.5 for a quicker look). A group
named in ``FOCUS`` draws only from the functions listed there, each
function's first mutant first.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYTEST = f"{sys.executable} -m pytest -x -q -p no:cacheprovider -o addopts= --timeout=900"

#: name -> (modules, tests, sampled mutants)
GROUPS: dict[str, tuple[list[str], list[str], int]] = {
    "feedback": (["gradpress/exchange/feedback.py"],
                 ["tests/test_references.py", "tests/test_config_fields.py", "tests/test_mutants_feedback.py"], 6),
    "engine": (["gradpress/exchange/engine.py", "gradpress/exchange/base.py"],
               ["tests/test_references.py", "tests/test_accounting.py", "tests/test_config_fields.py",
                "tests/test_mutants_engine.py"], 4),
    "strategies": ([f"gradpress/exchange/strategies/{m}.py" for m in ("allreduce", "allgather", "ring", "ps",
                                                                      "recompress", "rounds")],
                   ["tests/test_references.py", "tests/test_accounting.py", "tests/test_config_fields.py"], 6),
    "accounting": (["gradpress/transport/wire.py", "gradpress/transport/collectives.py",
                    "gradpress/transport/p2p.py", "gradpress/exchange/stats.py"],
                   ["tests/test_wire.py", "tests/test_accounting.py"], 4),
    "spec": (["gradpress/compress/spec.py", "gradpress/compress/registry.py"],
             ["tests/test_spec_registry.py", "tests/test_compressors.py", "tests/test_mutants_spec.py"], 30),
    "quantizers": ([f"gradpress/compress/{m}.py" for m in ("qsgd", "natural", "randomk", "terngrad", "dithering")],
                   ["tests/test_power.py", "tests/test_unbiased.py"], 30),
    "diloco": (["gradpress/algorithms/diloco.py"],
               ["tests/test_diloco_switch.py", "tests/test_diloco_keep_switch.py", "tests/test_diloco_residual_decay.py",
                "tests/test_algorithms_outer.py", "tests/test_references.py"], 10),
    "lsgd": (["gradpress/algorithms/lsgd.py"], ["tests/test_algorithms_lsgd.py", "tests/test_lsgd_average.py"], 10),
    "support": ([f"gradpress/exchange/strategies/{m}.py" for m in ("union", "cyclic", "support")],
                ["tests/test_union.py", "tests/test_cyclic.py"], 10),
    "streaming": (["gradpress/algorithms/streaming.py"], ["tests/test_streaming_buffers.py", "tests/test_algorithms_outer.py"], 8),
    "localsgd": (["gradpress/algorithms/localsgd.py"], ["tests/test_algorithms.py", "tests/test_references.py"], 6),
    "gossip": ([f"gradpress/algorithms/{m}.py" for m in ("sgp", "choco", "gossip", "gossip_codec")],
               ["tests/test_gossip.py", "tests/test_gossip_state.py"], 8),
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
             "tests/test_wire.py", "tests/test_compressors.py", "tests/test_kit_identity.py"], 10),
    "sparsifiers": ([f"gradpress/compress/{m}.py" for m in ("topk", "sparse", "threshold", "dgc", "dgc_threshold", "sidco",
                                                           "_threshold_select", "gaussiank", "redsync")],
                    ["tests/test_sparse_kernels.py", "tests/test_compressors.py", "tests/test_estimators.py",
                     "tests/test_literature.py"], 12),
    "signs": ([f"gradpress/compress/{m}.py" for m in ("signs", "signsgd", "efsignsgd", "signum", "onebit", "minmax8",
                                                     "powersgd", "halfprec")],
              ["tests/test_powersgd_exact.py", "tests/test_compressors.py", "tests/test_efsignsgd_chunk.py",
               "tests/test_compressor_traits.py", "tests/test_literature.py", "tests/test_kit_identity.py"], 12),
    "planner": ([f"gradpress/exchange/{m}.py" for m in ("planner", "plans", "costs", "pieces")],
                ["tests/test_plan.py", "tests/test_accounting.py", "tests/test_hierarchical.py"], 8),
    "hook": ([f"gradpress/ddp/{m}.py" for m in ("hook", "register", "ranks")], ["tests/test_ddp.py"], 8),
    "guards": ([f"gradpress/exchange/{m}.py" for m in ("agree", "nonfinite", "state", "background")],
               ["tests/test_exchange_hardening.py", "tests/test_config_fields.py", "tests/test_mutants_engine.py",
                "tests/test_comprex_parts.py"], 8),
    "decode": ([f"gradpress/compress/{m}.py" for m in ("packet", "base", "signs", "signsgd", "signum", "halfprec",
                                                      "efsignsgd", "natural", "minmax8", "qsgd", "onebit", "terngrad",
                                                      "bits")]
               + ["gradpress/compress/kit/declare.py", "gradpress/compress/kit/primitives.py",
                  "gradpress/compress/kit/reductions.py",
                  "gradpress/exchange/base.py"],
               ["tests/test_decode_into.py", "tests/test_kit_primitives.py", "tests/test_mutants_decode.py",
                "tests/test_compressors.py"], 30),
    "state": (["gradpress/train/checkpoint.py", "gradpress/ddp/state_format.py", "gradpress/algorithms/base.py",
               "gradpress/train/optim.py"],
              ["tests/test_mutants_state.py", "tests/test_torch_compat.py", "tests/test_review_resume.py",
               "tests/test_exchange_hardening.py::test_version_one_hook_state_loads",
               "tests/test_review_ddp_names.py",
               "tests/test_train_hardening.py::test_hook_state_dict_loads_with_weights_only",
               "tests/test_train_hardening.py::test_damaged_tensor_bytes_are_refused_on_load",
               "tests/test_train_hardening.py::test_bad_checkpoint_is_one_line_and_exit_2",
               "tests/test_train_hardening.py::test_malformed_load_state_dict_raises_value_error_and_changes_nothing",
               "tests/test_train.py", "tests/test_algorithms.py"], 20),
    "numerics": ([f"gradpress/compress/{m}.py" for m in ("numerics", "sampling", "_density")],
                 ["tests/test_mutants_numerics.py", "tests/test_efsignsgd_chunk.py", "tests/test_summand_bound.py",
                  "tests/test_extreme.py", "tests/test_estimators.py"], 20),
    "codecs": ([f"gradpress/compress/{m}.py" for m in ("adacomp", "compose", "fft", "rangefloat")]
               + ["gradpress/compress/kit/streams.py"],
               ["tests/test_mutants_codecs.py", "tests/test_compressors.py", "tests/test_compressor_traits.py",
                "tests/test_literature.py", "tests/test_kit_streams.py", "tests/test_extreme.py"], 20),
    "algobase": (["gradpress/algorithms/base.py", "gradpress/algorithms/loss_probe.py", "gradpress/algorithms/registry.py"],
                 ["tests/test_mutants_algobase.py", "tests/test_algorithms.py", "tests/test_review_sync_skip.py",
                  "tests/test_algorithms_lsgd.py"], 20),
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
    "train": ([f"gradpress/train/{m}.py" for m in ("loop", "session", "evaluate", "algorithm", "report")],
              ["tests/test_mutants_train.py", "tests/test_mutants_train_session.py",
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
        "gradpress/algorithms/base.py": ["Algorithm.__init__", "Algorithm.exchanged_params", "Algorithm.gradients",
                                         "Algorithm.local_step", "Algorithm._reset_last", "Algorithm.ddp_step",
                                         "Algorithm.sync", "Algorithm.average_plain", "Algorithm.broadcast_model",
                                         "Algorithm.consensus_model"],
    },
}
#: binary operators that never occur in these modules' arithmetic on tensors and floats: replacing
#: ``+`` by ``<<`` or ``%`` only gives type errors (incompetent mutants), never a plausible bug
EXCLUDED_OPERATORS = [
    "core/ReplaceBinaryOperator_.*_(LShift|RShift|BitOr|BitXor|BitAnd|FloorDiv|Pow|Mod)$",
    "core/ReplaceBinaryOperator_(LShift|RShift|BitOr|BitXor|BitAnd|FloorDiv|Pow|Mod)_",
]


def tool(name: str) -> str:
    """A console script of this interpreter's environment (also when its bin/ is not on PATH)."""
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for f in files:
        if f and (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)


def write_config(path: Path, modules: list[str], tests: list[str]) -> None:
    lines = [
        "[cosmic-ray]",
        f"module-path = {json.dumps(modules)}",
        "timeout = 900.0",
        "excluded-modules = []",
        f"test-command = {json.dumps(PYTEST + ' ' + ' '.join(tests))}",
        "",
        "[cosmic-ray.distributor]",
        'name = "local"',
        "",
        "[cosmic-ray.filters.operators-filter]",
        f"exclude-operators = {json.dumps(EXCLUDED_OPERATORS)}",
        "",
    ]
    path.write_text("\n".join(lines))


def compiles(module_path: str, operator_name: str, occurrence: int) -> bool:
    """Whether the mutant is valid Python: cosmic-ray also rewrites the bare ``*`` of a keyword-only
    signature (``def f(a, *, b)`` -> ``def f(a, +, b)``), a syntax error that every test "kills"."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    code = mutate_code(Path(module_path).read_text(), get_operator(operator_name)(), occurrence)
    try:
        compile(code or "", module_path, "exec")
    except SyntaxError:
        return False
    return True


def _definitions(tree: ast.AST, prefix: str = "") -> dict[str, ast.AST]:
    """Every function and class under ``tree`` by qualified name (``Class.method``)."""
    found: dict[str, ast.AST] = {}
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[prefix + child.name] = child
            found.update(_definitions(child, prefix + child.name + "."))
    return found


def focus_lines(work: Path, name: str) -> dict[str, dict[int, str]]:
    """Per focused module of group ``name`` (:data:`FOCUS`), each line of its focused functions
    (decorators included) mapped to the innermost focused function holding it (``module:qualname``);
    KeyError naming a function the module does not define."""
    lines: dict[str, dict[int, str]] = {}
    for module, wanted in FOCUS.get(name, {}).items():
        found = _definitions(ast.parse((work / module).read_text()))
        missing = [f for f in wanted if f not in found]
        if missing:
            raise KeyError(f"FOCUS[{name!r}][{module!r}]: {missing} not defined there; defined: {sorted(found)}")
        spans = {f: range(min([found[f].lineno] + [d.lineno for d in getattr(found[f], "decorator_list", [])]),
                          (found[f].end_lineno or found[f].lineno) + 1) for f in wanted}
        lines[module] = {}
        for f in sorted(wanted, key=lambda f: -len(spans[f])):  # the innermost function last: it wins
            lines[module].update({n: f"{module}:{f}" for n in spans[f]})
    return lines


def _where(w: Any, focus: dict[str, dict[int, str]]) -> str | None:
    """The focused function holding work item ``w``'s mutation; its module where that is drawn whole;
    None outside the focus."""
    m = w.mutations[0]
    module = Path(m.module_path).as_posix()
    if module not in focus:
        return module
    return focus[module].get(m.start_pos[0])


def sample(session: Path, keep: int, seed: str, work: Path, focus: dict[str, dict[int, str]] | None = None) -> tuple[int, int, int]:
    """Mark all but ``keep`` pending work items (a seeded random choice) skipped.

    Invariant: the same code and seed give the same sample, and a larger ``keep`` gives a superset
    (``random.sample`` draws a prefix-consistent sequence); a drawn mutant that does not compile is
    replaced by the next seeded draw and counted (third value returned), never run. ``focus``
    (module -> lines, :func:`focus_lines`): mutants of those modules outside those lines are marked
    skipped ("not in focus") before the draw, and the first value counts only the mutants drawn from.
    """
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(session)) as db:
        # job ids are random (uuid4): order by what the mutant is, so the same code gives the same sample
        pending = sorted(db.pending_work_items, key=lambda w: (str(w.mutations[0].module_path),
                                                               w.mutations[0].operator_name, w.mutations[0].occurrence))
        focus = focus or {}
        outside = [w for w in pending if _where(w, focus) is None]
        for w in outside:
            db.set_result(w.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="not in focus"))
        pending = [w for w in pending if _where(w, focus) is not None]
        rng = random.Random(seed)
        if focus:
            # each focused function's first mutant in a seeded shuffle, then the rest of the shuffle: a
            # sample at least as large as the number of functions covers every one; still prefix-consistent
            order = pending[:]
            rng.shuffle(order)
            seen: set[str | None] = set()
            firsts = [w for w in order if _where(w, focus) not in seen and not seen.add(_where(w, focus))]
            first_ids = {w.job_id for w in firsts}
            order = firsts + [w for w in order if w.job_id not in first_ids]
            drawn, rest = order[:keep], order[keep:]
        else:
            drawn = rng.sample(pending, min(keep, len(pending)))
            rest = [w for w in pending if w.job_id not in {d.job_id for d in drawn}]
        chosen: set[str] = set()
        invalid = 0
        while drawn:
            w = drawn.pop(0)
            m = w.mutations[0]
            if compiles(str(work / m.module_path), m.operator_name, m.occurrence):
                chosen.add(w.job_id)
            else:
                invalid += 1
                if rest:
                    drawn.append(rest.pop(0) if focus else rest.pop(rng.randrange(len(rest))))
        for w in pending:
            if w.job_id not in chosen:
                db.set_result(w.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="not sampled"))
        return len(pending), len(chosen), invalid


def results(session: Path) -> list[dict]:
    con = sqlite3.connect(session)
    rows = con.execute(
        "SELECT m.module_path, m.operator_name, m.occurrence, m.start_pos_row, r.worker_outcome, r.test_outcome, "
        "r.diff, substr(r.output, 1, 40), m.job_id FROM mutation_specs m JOIN work_results r ON m.job_id = r.job_id"
    ).fetchall()
    con.close()
    out = [dict(zip(("module", "operator", "occurrence", "line", "worker", "test", "diff", "note", "job"), r))
           for r in rows]
    for r in out:  # enums are stored by name
        r["worker"] = (r["worker"] or "").lower()
        r["test"] = (r["test"] or "").lower()
    return out


def run_group(work: Path, name: str, modules: list[str], tests: list[str], keep: int) -> dict:
    cfg, session = work / f"mutants-{name}.toml", work / f"mutants-{name}.sqlite"
    write_config(cfg, modules, tests)
    env = dict(os.environ, PYTHONPATH=str(work))
    _pristine(work, modules, restore=False)
    subprocess.run([tool("cosmic-ray"), "init", str(cfg), str(session), "--force"], cwd=work, check=True, env=env)
    subprocess.run([tool("cr-filter-operators"), str(session), str(cfg)], cwd=work, check=True, env=env)
    total, chosen, invalid = sample(session, keep, seed=f"gradpress-{name}", work=work, focus=focus_lines(work, name))
    t0 = time.time()
    subprocess.run([tool("cosmic-ray"), "exec", str(cfg), str(session)], cwd=work, check=True, env=env)
    meta = {"name": name, "modules": modules, "tests": tests, "candidates": total, "sampled": chosen,
            "invalid": invalid, "seconds": round(time.time() - t0)}
    (work / f"mutants-{name}.json").write_text(json.dumps(meta))
    return load_group(work, name)


def load_group(work: Path, name: str) -> dict:
    """A finished group of ``work``: its metadata and every sampled mutant's outcome."""
    group = json.loads((work / f"mutants-{name}.json").read_text())
    every = [r for r in results(work / f"mutants-{name}.sqlite") if r["note"] not in ("Filtered operator", "not in focus")]
    group["per_module"] = {m: sum(1 for r in every if r["module"] == m) for m in {r["module"] for r in every}}
    group["rows"] = [r for r in every if r["worker"] != "skipped"]
    return group


def _pristine(work: Path, modules: list[str], restore: bool) -> None:
    """Keep a copy of each of ``modules`` as copied into ``work`` (under
    ``.pristine/``: ``restore`` False, when the group runs), or write the
    kept copy back (``restore`` True, before a recheck): an interrupted
    ``cosmic-ray exec`` leaves the module it was testing mutated."""
    for m in modules:
        kept = work / ".pristine" / m
        if restore:
            if kept.is_file():
                shutil.copy2(kept, work / m)
        else:
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(work / m, kept)


def recheck(work: Path, name: str) -> list[dict]:
    """Run the survivors of a kept group again, against the tests as they are now
    (the test files are copied over the kept tree; the mutated modules are not):
    a survivor that got a test must now be killed. Returns the survivors' new rows.

    The survivors' jobs are written to ``mutants-NAME-recheck.json`` before
    their rows are cleared, and read back by a later recheck, so an
    interrupted recheck can be run again; the group's modules are first
    restored from the copy kept when the group ran (:func:`_pristine`)."""
    for f in subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "tests"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0"):
        if f and (ROOT / f).is_file():
            (work / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, work / f)
    modules, tests, _ = GROUPS[name]
    cfg, session = work / f"mutants-{name}.toml", work / f"mutants-{name}.sqlite"
    write_config(cfg, modules, tests)
    _pristine(work, modules, restore=True)
    pending = work / f"mutants-{name}-recheck.json"  # a recheck's jobs, whatever their rows say now
    earlier = json.loads(pending.read_text()) if pending.is_file() else []
    jobs = sorted({r["job"] for r in results(session) if r["test"] == "survived"} | set(earlier))
    pending.write_text(json.dumps(jobs))
    con = sqlite3.connect(session)
    con.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in jobs])
    con.commit()
    con.close()
    env = dict(os.environ, PYTHONPATH=str(work))
    subprocess.run([tool("cosmic-ray"), "exec", str(cfg), str(session)], cwd=work, check=True, env=env)
    return [r for r in results(session) if r["job"] in jobs]


def score(rows: list[dict]) -> tuple[int, int, int, str]:
    killed = sum(1 for r in rows if r["test"] == "killed")
    survived = sum(1 for r in rows if r["test"] == "survived")
    other = len(rows) - killed - survived
    pct = f"{100 * killed / (killed + survived):.0f}%" if killed + survived else "n/a"
    return killed, survived, other, pct


def report(groups: list[dict]) -> str:
    out = ["| group | modules | tests | mutants (candidates) | sampled | redrawn (no compile) | killed | survived | "
           "incompetent | score | time |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    all_rows = []
    for g in groups:
        k, s, o, pct = score(g["rows"])
        all_rows += g["rows"]
        out.append(f"| {g['name']} | {', '.join(Path(m).name for m in g['modules'])} | "
                   f"{', '.join(Path(t).name for t in g['tests'])} | {g['candidates']} | {g['sampled']} | {g.get('invalid', 0)} | "
                   f"{k} | {s} | "
                   f"{o} | {pct} | {g['seconds']} s |")
    k, s, o, pct = score(all_rows)
    out.append(f"| **all** | | | | {len(all_rows)} | {sum(g.get('invalid', 0) for g in groups)} | {k} | {s} | {o} | **{pct}** | "
               f"{sum(g['seconds'] for g in groups)} s |")
    out += ["", "Per module:", "", "| module | candidates | sampled | killed | survived | score |",
            "|---|---|---|---|---|---|"]
    candidates = {m: c for g in groups for m, c in g.get("per_module", {}).items()}
    for module in sorted(candidates):
        rows = [r for r in all_rows if r["module"] == module]
        k, s, o, pct = score(rows)
        out.append(f"| {module} | {candidates[module]} | {len(rows)} | {k} | {s} | {pct} |")
    survivors = [r for r in all_rows if r["test"] == "survived"]
    out += ["", f"Survivors ({len(survivors)}):", ""]
    for r in survivors:
        out += [f"- `{r['module']}` line {r['line']}, {r['operator']} #{r['occurrence']}:", "", "```diff",
                (r["diff"] or "").strip(), "```", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", default="bench-results/mutants-report.md")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--group", action="append", choices=sorted(GROUPS))
    parser.add_argument("--keep", help="keep the work directory (its sessions) at this path")
    parser.add_argument("--recheck", metavar="DIR",
                        help="run the survivors of the groups kept in DIR (--keep) again against the current tests")
    args = parser.parse_args(argv)
    if not Path(tool("cosmic-ray")).exists():
        print("cosmic-ray is not installed: pip install -e '.[mutants]'", file=sys.stderr)
        return 2
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    if args.recheck:
        work = Path(args.recheck)
        names = args.group or [n for n in GROUPS if (work / f"mutants-{n}.json").exists()]
        rows = [r for n in names for r in recheck(work, n)]
        text = "\n".join([f"Survivors run again against the current tests ({len(rows)}):", ""] + [
            f"- `{r['module']}` line {r['line']}, {r['operator']} #{r['occurrence']}: {r['test'] or r['worker']}"
            for r in rows])
        Path(args.report).write_text(text + "\n")
        print(text)
        return 0
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gradpress-mutants-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        copy_tree(work)
        done = []
        for name in args.group or list(GROUPS):
            modules, tests, keep = GROUPS[name]
            done.append(run_group(work, name, modules, tests, max(1, round(keep * args.scale))))
            Path(args.report).write_text(report(done) + "\n")
        text = report(done) + f"\n\nTotal wall time: {round(time.time() - t0)} s.\n"
        Path(args.report).write_text(text)
        print(text)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
