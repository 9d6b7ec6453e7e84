"""``make mutants``: sampled mutation testing of the core modules with cosmic-ray.

Never touches the working tree: the files git knows (tracked and untracked
but not ignored) are copied to a temporary directory, and cosmic-ray mutates
and restores files there. One cosmic-ray session per group of modules, each
run against the fast tests that cover it (marked ``mutants``): multi-process
tests cost tens of seconds per mutant on 2 cores, so each group draws a fixed
sample of its mutants (seeded: the same sample on every run of the same
code) and marks the rest skipped. Writes a markdown report (score per module
and the diff of every survivor) to ``--report``.

Usage: python tests/mutants.py [--report FILE] [--scale X] [--group NAME ...] [--module PATH ...]
``--scale`` multiplies every sample size (0.5 for a quicker look). A group
named in ``FOCUS`` draws only from the functions listed there, each
function's first mutant first. ``--module`` mutates only those modules of
the groups run (a module new in a group, without re-running the rest).
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

if str(ROOT / "tests") not in sys.path:  # loaded by path (importlib) rather than run or imported from tests/
    sys.path.insert(0, str(ROOT / "tests"))
from mutant_groups import FOCUS, GROUPS  # noqa: E402 - the groups' table, beside this script

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
    parser.add_argument("--module", action="append", metavar="PATH",
                        help="mutate only these modules of the groups run (e.g. gradpress/algorithms/alarm.py)")
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
    names = args.group or list(GROUPS)
    if args.module:
        listed = {m for n in names for m in GROUPS[n][0]}
        unknown = [m for m in args.module if m not in listed]
        if unknown:
            parser.error(f"--module got {', '.join(unknown)}, in none of the groups run; allowed: "
                         f"{', '.join(sorted(listed))}")
        names = [n for n in names if set(GROUPS[n][0]) & set(args.module)]
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gradpress-mutants-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        copy_tree(work)
        done = []
        for name in names:
            modules, tests, keep = GROUPS[name]
            modules = [m for m in modules if not args.module or m in args.module]
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
