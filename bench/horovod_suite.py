"""Horovod 0.28.1's own TF/Keras tests, run against elastic_hvd (issue 19).

Why: our tests check what we think Horovod does; Horovod's test files
(``test/parallel/test_*tensorflow*.py``, ``test_*keras*.py``) are what Horovod checks
itself.  This runs each of their test ids as its own 2-rank job under
``elastic-hvd-run --as-horovod`` (``import horovod`` gives elastic_hvd), on Keras 3 and on
tf_keras (``TF_USE_LEGACY_KERAS=1``), and classifies every failure with the rules in
``RULES``: a *declared refusal* of elastic_hvd, the test file's own *Keras-2 code*
failing on Keras 3 (or TF1 code on TF 2.21), or else *ours*.

    .venv/bin/python bench/horovod_suite.py --horovod-src ../.mirror/horovod+horovod/repo
    .venv/bin/python bench/horovod_suite.py --horovod-src DIR --keras 3 -k _fused

``--horovod-src`` is a checkout of github.com/horovod/horovod or its git directory (a
bare mirror); from a git directory the files of ``--ref`` are extracted to a temporary
directory (nothing of Horovod's is written into this project).  Horovod's test helpers
need ``cloudpickle``, ``mock`` and ``parameterized`` (``make compat-horovod`` installs
them).  Results go to ``--out`` (JSON; a later run with ``-k`` or ``--only failed``
replaces only the ids it ran), the table to stdout and ``--md``.  One job at a time:
each is 2 ranks.

This module is also the pytest plugin the ranks load (``-p horovod_suite``): with
``$HVD_SUITE_REPORTS`` set, every test report is appended to
``$HVD_SUITE_REPORTS/rank<N>.jsonl``.
"""

import argparse
import ast
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
KERAS = ("3", "tf_keras")

# Known reasons, first match wins: (category, test-id regex or None, error regex or None,
# note).  The error regex is searched in the exception lines (pytest's "E" lines) of every
# failing report of both ranks; a "keras2" rule only where no traceback went through
# elastic_hvd's code (the test file's own code failed).  Anything unmatched is "ours".
RULES = [
    # elastic_hvd's refusals (their messages: elastic_hvd/core/errors.py, tensorflow/gradients.py,
    # horovod_alias.py)
    ("refusal", None, r"TF1 sessions are not supported by elastic_hvd's elastic state",
     "elastic state in TF1 sessions is refused"),
    ("refusal", None, r"(\S+) is a part of Horovod that elastic_hvd does not provide",
     "a Horovod internal, not provided"),
    # the test files' own Keras-2 / TF1 code
    ("keras2", None, r"np\.float16\(0\.0\) not less than 1e-08",
     "numpy 2 (NEP 50) in the file: it compares a float16 error of 0.0 with 1e-08, which "
     "numpy 2 rounds to float16 0.0 (numpy 1 compared in float64); the gradient is exact"),
    ("keras2", None, r"module 'tensorflow' has no attribute 'ConfigProto'",
     "TF1 API (tf.ConfigProto) in the file: gone in TF 2.21"),
    ("keras2", None, r"Argument\(s\) not recognized: \{'lr'",
     "optimizer(lr=...): Keras 3 knows only learning_rate="),
    ("keras2", None, r"`keras\.optimizers\.legacy` is not supported in Keras 3",
     "keras.optimizers.legacy: not in Keras 3"),
    ("keras2", None, r"'Variable' object has no attribute 'ref'",
     "Variable.ref() on a Keras 3 variable (a tf.Variable's method)"),
    ("keras2", None, r"keras\.losses' has no attribute 'mean_squared_error'",
     "keras.losses.mean_squared_error: not in Keras 3's tf.keras"),
    ("keras2", None, r"BaseOptimizer\.__init__\(\) missing 1 required positional argument: "
     r"'learning_rate'", "an Optimizer subclass without learning_rate: Keras 3 requires it"),
    ("keras2", None, r"Unrecognized keyword arguments passed to BatchNormalization: "
     r"\{'fused'", "BatchNormalization(fused=...): not in Keras 3"),
]
CATEGORIES = ("ours", "refusal", "keras2")

# What the table says of a test whatever its result: (test-id regex, note).
NOTES = [
    (r"::test_horovod_broadcast_inplace_cpu$",
     "slow (~30-50 s; timed out at 180 s beside a soak): its graph half builds 96 variables, "
     "initializers and broadcast_ in one TF1 graph, and TF's cost per session.run grows with "
     "the graph.  Each fetch runs only its own broadcast since bbe8e31 (before, all the "
     "earlier ones too: 2352 collectives instead of 96 for 48 broadcast_ fetched twice, "
     "bench/graph_order_bench.py --tf1), which changed its time by less than the noise"),
    (r"^test_tensorflow2_keras_process_sets\.py::|^test_process_sets_(static|multi_comm)\.py::",
     "4 ranks (FILE_NP)"),
    (r"^test_tensorflow_process_sets_dynamic\.py::",
     "with HOROVOD_DYNAMIC_PROCESS_SETS=1, as Horovod's CI runs it"),
]

#: Files whose tests run on more ranks than 2 (where 2 would leave a set of one rank on
#: each side, which checks little).
FILE_NP = {"test_tensorflow2_keras_process_sets.py": 4, "test_process_sets_static.py": 4,
           "test_process_sets_multi_comm.py": 4}

#: Extra environment of a file's jobs, as Horovod's CI gives it.
FILE_ENV = {"test_tensorflow_process_sets_dynamic.py": {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}}


# -- the pytest plugin side (runs in the ranks) ------------------------------------------


def _record(report, kind):
    folder = os.environ.get("HVD_SUITE_REPORTS")
    if not folder or report.outcome == "passed" and kind == "collect":
        return
    longrepr = report.longrepr
    crash = getattr(getattr(longrepr, "reprcrash", None), "message", None)
    if isinstance(longrepr, tuple):  # a skip: (path, line, "Skipped: reason")
        crash, text = longrepr[2], longrepr[2]
    else:
        text = str(longrepr) if longrepr is not None else ""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    ours = sorted(set(re.findall(r"elastic_hvd/[\w/]+\.py:\d+", text)))
    rec = {"kind": kind, "when": getattr(report, "when", "collect"), "outcome": report.outcome,
           "xfail": hasattr(report, "wasxfail"), "crash": crash or (errors or [None])[-1],
           "errors": errors[-40:], "ours_frames": ours,
           "sub": (getattr(report.context, "msg", None) or "subtest")  # a subTest's report
           if hasattr(report, "context") else None}
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    with open(os.path.join(folder, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def pytest_runtest_logreport(report):
    _record(report, "test")


def pytest_collectreport(report):
    _record(report, "collect")


# -- the driver side ---------------------------------------------------------------------


def extract(src, ref, dest):
    """The directory holding Horovod's test/parallel (extracted from a git dir)."""
    if os.path.isdir(os.path.join(src, "test", "parallel")):
        return os.path.join(src, "test", "parallel")
    git = ["git", "--git-dir", src]
    names = subprocess.run(git + ["ls-tree", "-r", "--name-only", ref, "test/parallel",
                                  "test/utils", "test/conftest.py"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
        with open(os.path.join(dest, name), "wb") as f:
            f.write(subprocess.run(git + ["show", f"{ref}:{name}"], check=True,
                                   capture_output=True).stdout)
    return os.path.join(dest, "test", "parallel")


def environment(keras, **extra):
    env = dict(os.environ, **extra)
    env.pop("TF_USE_LEGACY_KERAS", None)
    if keras == "tf_keras":
        env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def test_ids(folder, files, keras):
    """pytest's ids of the tests in ``files`` (one process, ``--collect-only``); for a file
    that does not import, the test methods (unittest classes) and functions it defines."""
    out = subprocess.run([sys.executable, "-m", "elastic_hvd.runner.as_horovod", "-m", "pytest",
                          "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=folder, env=environment(keras), capture_output=True, text=True,
                         timeout=600).stdout
    collected = [line for line in out.splitlines() if re.match(r"[\w.]+\.py::\S+$", line)]
    ids = []
    for name in files:
        mine = [i for i in collected if i.startswith(name + "::")]
        if not mine:
            with open(os.path.join(folder, name)) as f:
                tree = ast.parse(f.read())
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    mine += [f"{name}::{node.name}::{m.name}" for m in node.body
                             if isinstance(m, ast.FunctionDef) and m.name.startswith("test")]
                elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                    mine.append(f"{name}::{node.name}")
        ids += mine
    return ids


def strays(token):
    """{pid: command line} of the processes carrying this job's marker in their environment
    (mpirun starts the ranks in sessions of their own: killpg would not reach them)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"HVD_SUITE_JOB={token}".encode() in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        found[int(pid)] = c.read().replace(b"\0", b" ").decode()[:200]
        except OSError:
            pass
    return found


def reap(token, grace):
    """Kill what is left of a job once ``grace`` seconds have not seen it end; what was killed."""
    deadline = time.monotonic() + grace
    while (left := strays(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return sorted(left.values())


def run_one(folder, test_id, keras, timeout, work):
    """Run ``test_id`` as one job of 2 ranks (or ``FILE_NP``'s); its result record."""
    reports = tempfile.mkdtemp(dir=work)
    token = uuid.uuid4().hex
    file = test_id.split("::")[0]
    np_ = FILE_NP.get(file, 2)
    extra = FILE_ENV.get(file, {})
    env = environment(keras, HVD_SUITE_REPORTS=reports, HVD_SUITE_JOB=token,
                      PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                               os.environ.get("PYTHONPATH")])),
                      **extra)
    cmd = [os.path.join(BIN, "elastic-hvd-run"), "-np", str(np_), "--as-horovod"]
    for name in ("HVD_SUITE_REPORTS", "HVD_SUITE_JOB", "PYTHONPATH", "TF_USE_LEGACY_KERAS",
                 *extra):
        if name in env:
            cmd += ["-x", f"{name}={env[name]}"]
    cmd += [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no",
            "-p", "horovod_suite", test_id]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    timed_out, left = False, []
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        reap(token, 0)  # the ranks (a timeout's are not strays)
        out, _ = proc.communicate()
    seconds = time.monotonic() - start
    if not timed_out:
        left = reap(token, 5)
    recs = []
    for name in sorted(os.listdir(reports)):
        with open(os.path.join(reports, name)) as f:
            recs += [dict(json.loads(line), rank=name[4:-6]) for line in f]
    shutil.rmtree(reports, ignore_errors=True)
    text = out.decode(errors="replace")
    rec = outcome(recs, proc.returncode, timed_out, text, np_)
    rec.update(seconds=round(seconds, 1), rc=proc.returncode,
               strays=left)
    if rec["result"] in ("failed", "timeout"):
        rec["category"], rec["note"] = classify(test_id, rec)
        rec["tail"] = text[-3000:]
    return rec


def outcome(recs, rc, timed_out, text, ranks=2):
    """The result of one test from its ranks' reports.  Horovod's TF tests run as subtests
    in graph and in eager mode (``run_all_in_graph_and_eager_modes``): the test itself
    then "passes" even where every subtest was skipped, so the subtests decide."""
    fails = [r for r in recs if r["outcome"] == "failed"]
    skips = [r for r in recs if r["outcome"] == "skipped"]
    calls = [r for r in recs if r["when"] == "call"]
    judged = [r for r in calls if r.get("sub")] or calls
    passed_ranks = {r["rank"] for r in judged if r["outcome"] == "passed"}
    if timed_out:
        errors = [e for r in fails for e in r["errors"]] or error_lines(text)
        return {"result": "timeout", "message": "timed out", "errors": errors}
    if fails:
        first = next((r for r in fails if r["when"] == "call"), fails[0])
        return {"result": "failed", "message": first["crash"] or "?",
                "errors": [e for r in fails for e in r["errors"] or [r["crash"] or ""]],
                "ours_frames": sorted({f for r in fails for f in r.get("ours_frames", [])})}
    if len(passed_ranks) == ranks and rc == 0:
        part = [f"{r.get('sub') or 'part'} {r['crash'] or 'skipped'}" for r in skips]
        return {"result": "passed", "errors": [],
                "message": "; ".join(dict.fromkeys(part)).replace("Skipped:", "skipped:")}
    if skips:
        return {"result": "skipped", "message": skips[0]["crash"] or "", "errors": []}
    errors = error_lines(text)
    why = "passed, then" if passed_ranks else "no test result,"
    return {"result": "failed", "message": f"{why} exit status {rc}: "
            + (errors[-1] if errors else "?"), "errors": errors}


def error_lines(text):
    """The lines of a job's output that look like errors (where pytest reported nothing)."""
    pattern = re.compile(r"Error\b|Exception\b|error:|Abort|Killed|Segmentation")
    lines = [line.strip() for line in text.splitlines() if pattern.search(line)]
    return list(dict.fromkeys(lines))[-8:]


def classify(test_id, rec):
    """(category, note) of a failed or timed-out test, by ``RULES``."""
    text = "\n".join(rec["errors"])
    through_ours = rec.get("ours_frames", ["?"]) != []  # unknown: as if it went through ours
    for category, id_rule, error_rule, note in RULES:
        if id_rule and not re.search(id_rule, test_id):
            continue
        if error_rule and not re.search(error_rule, text):
            continue
        if category == "keras2" and through_ours:
            continue
        return category, note
    return "ours", None


def versions():
    code = ("import json, tensorflow as tf, keras, tf_keras, mpi4py.MPI as M; "
            "print(json.dumps({'tensorflow': tf.__version__, 'keras': keras.__version__, "
            "'tf_keras': tf_keras.__version__, "
            "'mpi': M.Get_library_version().split(',')[0].strip()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    info = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    commit = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    return dict(info, elastic_hvd=commit, python=sys.version.split()[0])


# -- the report --------------------------------------------------------------------------


def cell(rec):
    if rec is None:
        return "-"
    if rec["result"] in ("passed", "skipped"):
        return rec["result"]
    return f"{rec['result'].upper()} ({rec['category']})"


def reason(rec):
    if rec is None:
        return ""
    if rec["result"] == "passed":
        return rec["message"]
    if rec["result"] == "skipped":
        return rec["message"].replace("Skipped: ", "skipped: ")
    why = rec["note"] or rec["message"]
    return f"{rec['category']}: {why}"


def rows(data):
    results = data["results"]
    ids = sorted({i for k in KERAS for i in results.get(k, {})}, key=data["order"].index)
    for test_id in ids:
        recs = [results.get(k, {}).get(test_id) for k in KERAS]
        reasons = [reason(r) for r in recs]
        if reasons[0] == reasons[1]:
            why = reasons[0]
        else:
            why = "; ".join(f"{label}: {r}" for label, r in zip(("Keras 3", "tf_keras"), reasons)
                            if r)
        why = "; ".join([why] * bool(why) + [n for r, n in NOTES if re.search(r, test_id)])
        file, *_, name = test_id.split("::")
        yield f"{file}::{name}", cell(recs[0]), cell(recs[1]), why


def summary(data):
    parts = []
    for keras in KERAS:
        recs = list(data["results"].get(keras, {}).values())
        if not recs:
            continue
        count = {r: sum(rec["result"] == r for rec in recs) for r in ("passed", "skipped")}
        bad = [rec for rec in recs if rec["result"] in ("failed", "timeout")]
        timeouts = sum(rec["result"] == "timeout" for rec in bad)
        cats = ", ".join(f"{c} {sum(rec['category'] == c for rec in bad)}" for c in CATEGORIES)
        parts.append(f"{'Keras 3' if keras == '3' else keras} {count['passed']} passed, "
                     f"{count['skipped']} skipped, {len(bad)} failed ({cats})"
                     + (f" [{timeouts} of them timed out]" if timeouts else ""))
    return "horovod tests: " + "; ".join(parts)


def clip(text, width=160):
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1] + "…"


def markdown(data):
    meta = data["meta"]
    v = meta.get("versions", {})
    lines = [
        "# Horovod's own TF/Keras tests on elastic_hvd",
        "",
        f"Horovod {meta['ref']}'s `test/parallel` files whose name has `tensorflow` or "
        "`keras` (and the process-set files `test_process_sets_static.py`, "
        "`test_process_sets_multi_comm.py`, run with `--files`), each test id run as its own "
        "2-rank job (4 ranks for the files in the script's `FILE_NP`) "
        "(`elastic-hvd-run -np 2 --as-horovod python -m pytest FILE::Class::test`, "
        f"{meta['timeout']} s each), once on Keras 3 and once on tf_keras "
        "(`TF_USE_LEGACY_KERAS=1`). Generated by `bench/horovod_suite.py` "
        "(`make compat-horovod`), with these commands (each with its date and elastic_hvd "
        "commit, `-dirty`: with uncommitted changes in the tree):",
        "",
        *[f"    {run['command']}    # {run['date']}, elastic_hvd {run['elastic_hvd']}"
          for run in meta["runs"]],
        "",
        f"Versions: TensorFlow {v.get('tensorflow')}, Keras {v.get('keras')}, tf_keras "
        f"{v.get('tf_keras')}, {v.get('mpi')}, Python {v.get('python')}.",
        "",
        "The ids are those pytest collects (with TF's `test_session`, which TF skips as "
        "\"Not a test\"); this machine has no GPU, so the GPU tests skip. Horovod's TF tests "
        "run twice, as graph-mode and eager-mode subtests: one that skips in one mode and "
        "passes in the other counts as passed, with the skip noted. A failure's reason is "
        "*refusal* (elastic_hvd refuses this by design, with a message), *keras2* (the test "
        "file's own Keras-2 or TF1 code, which cannot run on Keras 3 / TF 2.21, or its "
        "numpy-1 arithmetic under numpy 2; only where "
        "no traceback went through elastic_hvd) or *ours* (elastic_hvd's; unexplained "
        "failures count as ours). The rules are `RULES` in the script.",
        "",
        f"**{summary(data)}**",
        "",
        "| test | Keras 3 | tf_keras | reason |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{t}` | {a} | {b} | {clip(why, 400)} |" for t, a, b, why in rows(data)]
    return "\n".join(lines) + "\n"


def print_table(data):
    table = list(rows(data))
    width = max([len(t) for t, *_ in table] + [4])
    print(f"{'test':{width}}  {'Keras 3':18}  {'tf_keras':18}  reason")
    for t, a, b, why in table:
        print(f"{t:{width}}  {a:18}  {b:18}  {clip(why, 200)}")
    print(summary(data))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--horovod-src", required=True,
                   help="a horovod checkout, or its git directory (bare mirror)")
    p.add_argument("--ref", default="v0.28.1", help="tag/commit, when --horovod-src is a git dir")
    p.add_argument("--keras", nargs="+", choices=KERAS, default=list(KERAS))
    p.add_argument("--files", nargs="+",
                   help="test files (default: test/parallel/test_*{tensorflow,keras}*.py)")
    p.add_argument("-k", action="append", default=[],
                   help="run only ids containing this text (repeatable: any of them)")
    p.add_argument("--timeout", type=float, default=180, help="seconds per test job")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "horovod-tests.json"))
    p.add_argument("--md", default=os.path.join(ROOT, "docs", "horovod-tests.md"))
    p.add_argument("--resume", action="store_true", help="skip ids already in --out")
    p.add_argument("--only", nargs="+", choices=("passed", "skipped", "failed", "timeout"),
                   help="run only the ids with these results in --out (per --keras)")
    p.add_argument("--report-only", action="store_true", help="only print/write from --out")
    args = p.parse_args()

    data = {"results": {}, "order": [], "meta": {}}
    if os.path.exists(args.out):
        with open(args.out) as f:
            data = json.load(f)
    work = tempfile.mkdtemp(prefix="horovod-tests-")
    try:
        if not args.report_only:
            folder = extract(os.path.abspath(args.horovod_src), args.ref, work)
            files = args.files or sorted(
                n for n in os.listdir(folder) if n.startswith("test_") and n.endswith(".py")
                and ("tensorflow" in n or "keras" in n))
            meta = data["meta"]
            command = " ".join([".venv/bin/python", "bench/horovod_suite.py", *sys.argv[1:]])
            meta.update(ref=args.ref, timeout=args.timeout, versions=versions())
            meta["runs"] = meta.get("runs", []) + [{
                "command": command, "date": datetime.date.today().isoformat(),
                "elastic_hvd": meta["versions"]["elastic_hvd"]}]
            for keras in args.keras:
                ids = test_ids(folder, files, keras)
                data["order"] = list(dict.fromkeys(data["order"] + ids))
                ids = [i for i in ids if not args.k or any(k in i for k in args.k)]
                done = data["results"].setdefault(keras, {})
                todo = [i for i in ids if not (args.resume and i in done)
                        and not (args.only and done.get(i, {}).get("result") not in args.only)]
                for n, test_id in enumerate(todo, 1):
                    rec = run_one(folder, test_id, keras, args.timeout, work)
                    done[test_id] = rec
                    print(f"[{n}/{len(todo)}] keras={keras} {test_id}: {cell(rec)} "
                          f"{rec['seconds']}s {clip(reason(rec), 200)}"
                          + (f" (STRAY processes killed: {rec['strays']})"
                             if rec["strays"] else ""), flush=True)
                    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                    with open(args.out, "w") as f:
                        json.dump(data, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for keras in KERAS:  # re-classify: the rules may have changed since a result was stored
        for test_id, rec in data["results"].get(keras, {}).items():
            if rec["result"] in ("failed", "timeout"):
                rec["category"], rec["note"] = classify(test_id, rec)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(data))
    print_table(data)


if __name__ == "__main__":
    main()
