"""What a user sees in TensorBoard, read back through TensorBoard's own server (its HTTP data
API, the one its pages call): every scalar's description, the custom-scalars layout and the
HParams table of settings and final metrics, for three tiny runs of the examples on thread
workers (two seeds of one method, one of another). The dashboard's picture is taken by a real
headless browser where one is installed (docs/tensorboard.md)."""

import json
import os
import shutil
import sys
import urllib.parse
import urllib.request

import pytest

from slowmo_lab import dashboard
from slowmo_lab.metrics import DESCRIPTIONS, TAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import common  # noqa: E402
import mnist1d_cnn  # noqa: E402

# Three tiny runs and two TensorBoard servers: tens of seconds, the default tier.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
RUNS = {"localsgd/seed0": ["--no-slowmo"], "localsgd-slowmo/seed0": ["--slowmo"]}
RUNS["localsgd-slowmo/seed1"] = ["--slowmo"]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    for name, flags in RUNS.items():
        argv = ["--threads", "2", "--algo", "localsgd", "--tau", "4", "--epoch-steps", "8"]
        argv += ["--epochs", "2", "--log-every", "4", "--no-progress", "--logdir", str(root)]
        argv += ["--run-name", name, "--seed", name[-1], *flags]
        assert common.run_cli(mnist1d_cnn.main, argv) == 0
    return str(root)


def get(url, path, **request):
    query = f"?request={urllib.parse.quote(json.dumps(request))}" if request else ""
    with urllib.request.urlopen(f"{url}{path}{query}", timeout=30) as r:
        return json.load(r)


def test_tags_layout_and_hparams_through_tensorboards_server(logdir):
    with dashboard.serve(logdir) as url:
        tags = get(url, "/data/plugin/scalars/tags")
        layout = get(url, "/data/plugin/custom_scalars/layout")
        experiment = get(url, "/data/plugin/hparams/experiment", experimentName="")
        statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
        groups = get(
            url,
            "/data/plugin/hparams/session_groups",
            experimentName="",
            allowedStatuses=statuses,
            startIndex=0,
            sliceSize=100,
            aggregationType="AGGREGATION_AVG",
        )

    # Every run has the timing split, the accuracy and the clock, each with its description.
    assert set(tags) == set(RUNS)
    want = ["iter_ms", "compute_ms", "base_comm_ms", "average_ms", "slow_update_ms"]
    want += ["train_s", "val_accuracy", "val_loss", "train_loss", "bytes_sent", "lr"]
    for run, run_tags in tags.items():
        for key in want:
            # TensorBoard renders the markdown: compare the first words, free of markup.
            first_words = DESCRIPTIONS[key].split(",")[0].split("(")[0].strip()
            assert first_words in run_tags[TAGS[key]]["description"], (run, key)
    assert TAGS["consensus"] in tags["localsgd-slowmo/seed0"]

    # The layout, merged from the runs' identical copies: each category once, its charts once.
    categories = {c["title"]: c["chart"] for c in layout["category"]}
    assert list(categories) == list(dashboard.LAYOUT)
    for title, charts in dashboard.LAYOUT.items():
        got = {c["title"]: c["multiline"]["tag"] for c in categories[title]}
        assert got == {chart: spec[1] for chart, spec in charts.items()}

    # HParams: the settings as columns, every scalar as a metric column, and the two seeds of
    # SlowMo in one session group (one row of the table).
    assert {h["name"] for h in experiment["hparamInfos"]} == set(dashboard.SETTINGS)
    metric_tags = {m["name"]["tag"] for m in experiment["metricInfos"]}
    assert {TAGS["val_accuracy"], TAGS["train_s"], TAGS["iter_ms"]} <= metric_tags
    by_size = sorted(groups["sessionGroups"], key=lambda g: len(g["sessions"]))
    assert [len(g["sessions"]) for g in by_size] == [1, 2]
    assert [g["hparams"]["slowmo"] for g in by_size] == [False, True]
    assert {s["name"] for s in by_size[1]["sessions"]} == set(RUNS) - {"localsgd/seed0"}
    assert by_size[0]["hparams"]["tau"] == 4 and by_size[0]["hparams"]["eager"] == "none"
    accuracy = {m["name"]["tag"]: m["value"] for m in by_size[0]["metricValues"]}
    assert 0 <= accuracy[TAGS["val_accuracy"]] <= 100


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="no headless browser: `apt-get install chromium` (Debian) takes the dashboard's picture",
)
def test_a_headless_browser_draws_the_dashboard(logdir, tmp_path):
    png = str(tmp_path / "custom_scalars.png")
    with dashboard.serve(logdir) as url:
        dashboard.screenshot(f"{url}/#custom_scalars", png)
    from matplotlib.image import imread

    picture = imread(png)
    assert picture.shape[:2] == (1000, 1600)
    # A drawn page, not a blank one: many distinct colours (text, chart lines, the header).
    assert len({tuple(px) for px in picture.reshape(-1, picture.shape[2])[::97].tolist()}) > 20
