"""benchmarks/project_pages.py's pure parts: which models the shipped pages need profiles of, and the table."""

from tests.scripts import load_benchmark
from trainscale.models import list_models

pages = load_benchmark("project_pages")


def test_every_published_model_is_registered_and_profiled_once():
    names = pages.clusters()
    assert {"pslite-gtx980", "mxnet-p2-8xlarge", "keras-p2-16xlarge", "multiverso-k40"} <= set(names)
    models = pages.models_of(pages.published_models(names))
    assert len(models) == len(set(models)) and {"inception_bn_small", "resnet50_mxnet", "resnet32"} <= set(models)
    assert set(models) <= set(list_models())  # a page's model that is not registered could not be profiled


def test_the_table_has_one_line_per_row_with_the_ratio():
    rows = [
        {
            "cluster": "c",
            "model": "m",
            "devices": 8,
            "hosts": 1,
            "batch": 128,
            "mode": "sync",
            "published": 2000.0,
            "predicted": 2500.0,
            "ratio": 1.25,
        }
    ]
    lines = pages.markdown(rows).splitlines()
    assert len(lines) == 3 and lines[2] == "| c | m | 8 | 1 | 128 | sync | 2,000 | 2,500 | 1.25 |"
