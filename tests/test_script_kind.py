"""Where a hot spare waits (``ELASTIC_HVD_SPARES_WAIT=auto``): read from the main
script's source, so it must tell the elastic API from a plain Horovod script."""

import ast
from pathlib import Path

import pytest

from elastic_hvd.growth_policy import has_growth_point

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("source, expected", [
    ("import horovod.tensorflow.keras as hvd\nhvd.init()\nmodel.fit(x, y)", False),
    ("import elastic_hvd.tensorflow.keras as hvd\nhvd.fit(model, data, epochs=3)", True),
    ("import elastic_hvd.tensorflow.keras as hvd\ndata = hvd.ElasticData(x, y, 16)", True),
    ("import horovod.tensorflow as hvd\n@hvd.elastic.run\ndef train(state): pass", True),
    ("from horovod.tensorflow import elastic\n@elastic.run\ndef train(state): pass", True),
    ("from elastic_hvd.tensorflow.keras import fit\nfit(model, data)", True),
    ("from keras_callbacks import fit_elastic\nfit_elastic(model, sampler)", True),
    ("import numpy as np\nclass Model:\n    def fit(self): pass\nModel().fit()", False),
])
def test_growth_points_are_told_from_plain_scripts(source, expected):
    assert has_growth_point(ast.parse(source)) is expected


@pytest.mark.parametrize("script, expected", [
    ("examples/fruits360/train.py", True),
    ("examples/elastic_keras.py", True),
    ("tests/workers/horovod_script.py", False),
    ("tests/workers/plain_spare.py", False),
    ("tests/workers/hvd_elastic_grow.py", True),
])
def test_the_projects_own_scripts(script, expected):
    assert has_growth_point(ast.parse((ROOT / script).read_text())) is expected
