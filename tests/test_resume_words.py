"""The words a user is told, and that they must be true (issue 42, findings 8 and 9).

What a run says about the checkpoint it starts from, on real 2-rank jobs run again in
the same checkpoint directory (``workers/resume_words.py``).  Before: a finished run's
directory made the next run train nothing and print "done", and only after that (on
stderr, which mpirun forwards apart from stdout) "resuming at epoch 3 from
ckpt-000001-e0002", with no word that nothing was left; a resumed run never said how
many epochs were left.

And what the docs name exists: the launcher's flags, the keyword arguments their code
passes, hvd.fit's arguments; ``--help`` on ``--spares`` says what docs/growth.md does.
"""

import ast
import inspect
import json
import re
import shutil
import subprocess
import sys

import pytest

from mpijob import ROOT, run_job

multirank = pytest.mark.multirank


def fit(tmp_path, directory, epochs):
    return run_job("resume_words.py", epochs, directory, np=2, tmp_path=tmp_path, timeout=180)


def lines(job):
    return job.output.splitlines()


def batches(job):
    return [line for line in lines(job) if line.startswith("batch ")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The checkpoint directory of a run that trained all its 2 epochs."""
    tmp = tmp_path_factory.mktemp("finished")
    job = fit(tmp, tmp / "ckpt", 2)
    assert batches(job)[0] == "batch 1.1" and batches(job)[-1] == "batch 2.4", job.output[-3000:]
    assert "resuming" not in job.output and "nothing left" not in job.output, job.output[-3000:]
    return tmp / "ckpt"


def copy_of(finished, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(finished, directory)  # keeps its 0700
    return directory


@multirank
def test_a_finished_runs_directory_says_nothing_is_left_and_exits_0(finished, tmp_path):
    directory = copy_of(finished, tmp_path)
    job = fit(tmp_path, directory, 2)  # the same run again: exit status 0 (run_job checks)
    said = [line for line in lines(job) if "nothing left to train" in line]
    assert len(said) == 1, job.output[-3000:]
    assert said[0].startswith("elastic_hvd: nothing left to train: the checkpoint "
                              "ckpt-000001-e0002 in "), said
    assert said[0].endswith(f"{directory} has trained 2 of 2 epochs; remove it or raise "
                            "epochs"), said
    assert batches(job) == [] and "done" not in lines(job), job.output[-3000:]
    assert "resuming" not in job.output, job.output[-3000:]


@multirank
def test_a_resumed_run_says_where_and_how_much_is_left_before_it_trains(finished, tmp_path):
    directory = copy_of(finished, tmp_path)
    job = fit(tmp_path, directory, 5)
    said = [i for i, line in enumerate(lines(job)) if "resuming" in line]
    assert len(said) == 1, job.output[-3000:]  # once, by rank 0
    line = lines(job)[said[0]]
    assert line.startswith("elastic_hvd: resuming at epoch 3 of 5 from ckpt-000001-e0002 "
                           "(3 epochs left; "), line
    first = lines(job).index("batch 3.1")  # epochs 1 and 2 are not trained again
    assert said[0] < first and batches(job)[0] == "batch 3.1", job.output[-3000:]
    assert batches(job)[-1] == "batch 5.4" and lines(job)[-1] == "done", job.output[-3000:]


# -- the docs name what exists ----------------------------------------------------------
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Pages whose flags are a benchmark's or an example's own, not the launcher's.
SCRIPT_PAGES = {"benchmarks.md", "fruits360.md", "horovod-tests.md"}
#: Open MPI's flags, which the docs name as such (mpirun, ompi_info).
OPEN_MPI_FLAGS = {"--with-ft", "--allow-run-as-root", "--oversubscribe", "--without-cuda",
                  "--mca", "--prtemca", "--bind-to", "--debug-daemons", "--forward-signals"}
#: Slurm's flags (sbatch, salloc, scancel), which docs/slurm.md and the README name as such.
SLURM_FLAGS = {"--no-kill", "--requeue", "--no-requeue", "--signal", "--batch",
               "--ntasks-per-node"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def launcher_flags():
    """Every option string of elastic-hvd-run, as ``--help`` lists them."""
    from elastic_hvd.runner import launch
    return {flag for line in launch.parser().format_help().splitlines()
            if line.startswith("  -") for flag in FLAG.findall(re.split(r"\s\s", line[2:])[0])}


def test_every_launcher_flag_the_docs_name_exists():
    flags, wrong = launcher_flags(), []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            # the launcher's part of a command line: up to the program, a comment, a cell's end
            named = [re.split(r"`|#|\|| python", part)[0]
                     for part in line.split("elastic-hvd-run")[1:]]
            if path.name not in SCRIPT_PAGES:  # and every flag the prose names
                named += re.findall(r"`([^`]*)`", line)
            for text in named:
                text = re.sub(r'"[^"]*"', "", text)  # --mpi-args "--bind-to none"
                wrong += [f"{path.name}:{number}: {flag}" for flag in FLAG.findall(text)
                          if flag not in flags | OPEN_MPI_FLAGS | SLURM_FLAGS]
    assert not wrong, f"no such elastic-hvd-run flag: {wrong}"


def documented_calls():
    """``(page, the call's dotted name, the call, torch)`` for every call of ``hvd.*`` or
    ``kc.*`` in the docs' Python blocks (which must be Python); ``torch``: the block is a
    PyTorch script (every block of docs/torch.md), whose ``hvd`` is ``elastic_hvd.torch``."""
    for path in DOCS:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            try:
                tree = ast.parse(block)
            except SyntaxError as exc:
                pytest.fail(f"{path.name}: a python block that is not Python ({exc}):\n{block}")
            torch = path.name == "torch.md" or re.search(
                r"\b(horovod|elastic_hvd)\.torch\b", block) is not None
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    name, func = [], node.func
                    while isinstance(func, ast.Attribute):
                        name, func = [func.attr, *name], func.value
                    if isinstance(func, ast.Name) and func.id in ("hvd", "kc") and name:
                        yield path.name, ".".join([func.id, *name]), node, torch


TORCH_PARAMETERS = """
import inspect, json, sys
import elastic_hvd.torch as hvd
out = {}
for name in json.loads(sys.argv[1]):
    target = hvd
    for part in name.split(".")[1:]:
        target = getattr(target, part)
    parameters = inspect.signature(target).parameters.values()
    out[name] = [p.name for p in parameters] + ["**" for p in parameters if p.kind is p.VAR_KEYWORD]
print(json.dumps(out))
"""


def torch_parameters(names):
    """The parameter names of ``elastic_hvd.torch``'s callables, read in a process of
    their own (this one has TensorFlow loaded)."""
    if not names:
        return {}
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-c", TORCH_PARAMETERS, json.dumps(sorted(names))],
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_every_keyword_the_docs_pass_exists():
    import tensorflow as tf

    import elastic_hvd.tensorflow.keras as hvd
    import keras_callbacks as kc
    wrong, checked = [], 0
    calls = list(documented_calls())
    torch = torch_parameters({name for _, name, _, in_torch in calls if in_torch})
    for page, name, call, in_torch in calls:
        if in_torch:
            names = torch[name]
            checked += len(call.keywords)
            wrong += [f"{page}: {name}({k.arg}=)" for k in call.keywords
                      if k.arg is not None and k.arg not in names and "**" not in names]
            continue
        target = {"hvd": hvd, "kc": kc}[name.split(".")[0]]
        for part in name.split(".")[1:]:
            target = getattr(target, part)
        parameters = inspect.signature(target).parameters
        if target is hvd.fit:  # the rest go to model.fit
            parameters = {**inspect.signature(tf.keras.Model.fit).parameters, **parameters}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        for keyword in call.keywords:
            checked += 1
            if keyword.arg is not None and keyword.arg not in parameters and not (
                    takes_any and target is not hvd.fit):
                wrong.append(f"{page}: {name}({keyword.arg}=)")
    assert checked >= 10 and not wrong, f"no such keyword argument: {wrong}"


def test_hvd_fits_arguments_in_training_md_are_its_own():
    import elastic_hvd.tensorflow.keras as hvd
    text = " ".join((ROOT / "docs" / "training.md").read_text().split())
    paragraph = text.split("Its arguments:")[1].split("Other keyword arguments")[0]
    named = set(re.findall(r"`([a-z_]+)(?:=[^`]*)?`", paragraph))
    assert len(named) >= 7, paragraph
    assert named <= set(inspect.signature(hvd.fit).parameters), \
        named - set(inspect.signature(hvd.fit).parameters)


def test_the_spares_help_says_what_the_docs_say():
    """A plain Horovod script regains its size with spares (docs/growth.md, the README,
    ELASTIC_HVD_SPARES_WAIT=init): before, ``--help`` said --spares needed a growth point."""
    from elastic_hvd.core import config
    from elastic_hvd.runner import launch
    text = " ".join(launch.parser().format_help().split())
    spares = text.split("--spares K ")[1].split(" --max-np")[0]
    assert "plain Horovod" in spares and "growth point" in spares, spares
    assert "needs a growth point" not in spares, spares
    growth = (ROOT / "docs" / "growth.md").read_text()
    assert "**Spares for a plain Horovod-style script**" in growth
    wait = next(s for s in config.SETTINGS if s.name == "spares_wait")
    assert "plain Horovod script" in " ".join(wait.doc.split()), wait
