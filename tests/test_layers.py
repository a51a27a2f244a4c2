"""The layers: core (and the framework-independent basics) import no framework layer,
hold none of its state, and the TF layer's state lives where it registers it."""

import ast
import dataclasses
import pathlib
import types

import pytest

from elastic_hvd.core import process
from elastic_hvd.core.session import Session

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "elastic_hvd"
#: What core and basics must not import, at run time or for the type checker.
FORBIDDEN = ("tensorflow", "keras", "tf_keras", "elastic_hvd.tensorflow", "elastic_hvd.keras",
             "keras_callbacks", "horovod")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports anywhere (functions, ``TYPE_CHECKING`` blocks):
    relative imports resolved, and ``from X import y`` counted as ``X`` and ``X.y``."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def forbidden_imports(path: pathlib.Path) -> list[str]:
    return sorted(name for name in imported_names(path)
                  if any(name == f or name.startswith(f + ".") for f in FORBIDDEN))


def checked_files() -> list[pathlib.Path]:
    return sorted((PACKAGE / "core").glob("*.py")) + [PACKAGE / "basics.py"]


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_and_basics_import_no_framework_layer(path):
    assert forbidden_imports(path) == []


def test_the_import_check_sees_every_form(tmp_path):
    # The check itself: relative, aliased, type-only and in-function imports are seen.
    core = tmp_path / "elastic_hvd" / "core"
    core.mkdir(parents=True)
    source = core / "example.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from .. import tensorflow\n"
        "if TYPE_CHECKING:\n"
        "    from keras_callbacks.lr import LearningRateRescaler\n"
        "def f():\n"
        "    from ..tensorflow.keras import replacement\n"
        "    import tensorflow as tf\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        found = forbidden_imports(source)
    finally:
        ROOT = old
    assert found == ["elastic_hvd.tensorflow", "elastic_hvd.tensorflow.keras",
                     "elastic_hvd.tensorflow.keras.replacement", "keras_callbacks.lr",
                     "keras_callbacks.lr.LearningRateRescaler", "tensorflow"]


def test_core_holds_no_layer_state():
    fields = {f.name for f in dataclasses.fields(process.Runtime)}
    assert not fields & {"policy", "growth_point", "timeline", "order_graph_collectives"}
    session = Session(types.SimpleNamespace(ids=[0], events=[]))
    assert "lr_factor" not in vars(session) and set(session.state()) == {"step", "applied"}
    from elastic_hvd.core import session as core_session
    assert not {"DATA", "LEARNING_RATE", "CHECKPOINT"} & set(vars(core_session))


def test_layer_state_is_one_object_per_class_and_holder():
    @dataclasses.dataclass
    class Part:
        value: int = 0

    layers = process.Layers()
    layers.get(Part).value = 3
    assert layers.get(Part).value == 3
    assert process.Layers().get(Part).value == 0  # another holder, another object


@pytest.fixture
def tf_runtime():
    """A runtime of its own with a session, without MPI (no init()): the session's
    communicator is only read for its size."""
    comm = types.SimpleNamespace(ids=[0, 1], events=[], size=2, replacing=None)
    old = process.use(process.Runtime(comm=comm, session=Session(comm)))
    yield
    process.use(old)


def test_the_tf_layer_keeps_its_state_in_the_runtime(tf_runtime):
    from elastic_hvd.tensorflow import elastic, layer, ordering  # noqa: F401
    assert layer.state() is process.runtime().layers.get(layer.State)
    assert layer.state().order_graph_collectives and layer.state().timeline is None
    policy = elastic.growth_policy()
    assert layer.state().policy is policy and elastic.growth_policy() is policy


def test_the_learning_rate_factor_travels_in_the_sessions_part(tf_runtime):
    # The training state's "session" part keeps the keys checkpoints have always had;
    # the factor is loaded from the same job only (membership), as before.
    from elastic_hvd.tensorflow import layer
    from elastic_hvd.tensorflow.training_state import TrainingState
    layer.session_state().lr_factor = 0.5
    saved = TrainingState(values={}).state()
    assert saved["session"] == {"step": 0, "lr_factor": 0.5, "applied": {}}
    layer.session_state().lr_factor = 2.0
    TrainingState(values={}).load_state(saved, membership=False)
    assert layer.session_state().lr_factor == 2.0
    TrainingState(values={}).load_state(saved)
    assert layer.session_state().lr_factor == 0.5
    # A new session (the next init()) starts at 1, as Session.lr_factor did.
    process.runtime().session = Session(process.runtime().comm)
    assert layer.session_state().lr_factor == 1.0


def test_the_keras_handler_orders_keep_their_numbers_around_core_report():
    from elastic_hvd.core.session import REPORT
    from keras_callbacks import base, lr
    assert (base.DATA, base.LEARNING_RATE, base.REPORT, base.CHECKPOINT) == (10, 20, 30, 40)
    assert base.LEARNING_RATE < REPORT == base.MembershipCallback.ORDER
    assert lr.LearningRateRescaler.ORDER == base.LEARNING_RATE


def test_the_tf_layer_registers_its_replacement_hook_with_basics():
    from elastic_hvd import basics
    import elastic_hvd.tensorflow as hvd_tf
    assert hvd_tf._install_replacement in basics._replacing_hooks
