"""What TensorBoard needs to compare runs, beyond the scalars: a description on every scalar, a
custom-scalars layout that puts each method's timing split and its accuracy against training
seconds on one page, and each run's settings and final metrics for the HParams dashboard.

:class:`~slowmo_lab.metrics.TrainingMonitor` writes all three into every run's event file (rank
0); TensorBoard merges the runs' identical layouts into one, and groups the HParams table by
setting, seeds together (docs/tensorboard.md).
"""

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import summary_v2
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.util import tensor_util

__all__ = ["LAYOUT", "SETTINGS", "hparams_summary", "scalar_summary", "screenshot", "serve"]

#: The custom-scalars page: category -> chart title -> ["Multiline", tag regexes]. A chart draws
#: every selected run's matching tags, so selecting one method's runs in the run list shows its
#: split. Scalars' wall time is the training clock, so the "Relative" horizontal axis is seconds
#: of training (evaluations left out).
LAYOUT: dict[str, dict[str, list[Any]]] = {
    "Timing split (ms per iteration; select one method's runs)": {
        "iteration = compute + base communication + exact average + slow update": [
            "Multiline",
            [r"^time/(iter|compute|base_comm|average|slow_update)_ms$"],
        ],
        "communication phases only": [
            "Multiline",
            [r"^time/(base_comm|average|slow_update)_ms$"],
        ],
        "bytes sent by rank 0": ["Multiline", [r"^comm/bytes_sent$"]],
    },
    "Accuracy and loss against training seconds (horizontal axis: Relative)": {
        "test accuracy of the averaged model (%)": ["Multiline", [r"^val/accuracy$"]],
        "held-out loss of the averaged model": ["Multiline", [r"^val/(loss|nll)$"]],
        "training loss": ["Multiline", [r"^train/(loss|full_loss)$"]],
        "seconds of training so far": ["Multiline", [r"^time/train_s$"]],
    },
    "Workers' drift": {
        "consensus distance before each exact average": ["Multiline", [r"^consensus/distance$"]],
    },
}

#: The configuration keys shown as HParams columns (``examples/common.run_config``'s, less the
#: seed: the seeds of one setting are one session group, and the table shows their mean).
SETTINGS = (
    "task",
    "algo",
    "slowmo",
    "tau",
    "slow_lr",
    "slow_momentum",
    "buffers",
    "average",
    "codec",
    "error_feedback",
    "overlap",
    "fragments",
    "eager",
    "mix",
    "optimizer",
    "workers",
    "batch_size",
    "lr",
    "epochs",
    "amp",
)


def scalar_summary(tag: str, value: float, description: str | None) -> Summary:
    """One scalar as an event's summary; with its description (markdown) when given.

    The value is a float32 tensor of the scalars plugin (as TensorFlow 2 writes scalars), not
    the older ``simple_value``: TensorBoard's fast loader drops a ``simple_value``'s description.
    TensorBoard keeps the metadata of a tag's first value, so the description needs writing once
    per run; ``SummaryWriter.add_scalar`` has no description argument.

    Args:
        tag: e.g. ``"time/iter_ms"``.
        value: the value.
        description: shown with the chart; None for a value after the first.
    """
    entry = Summary.Value(tag=tag, tensor=tensor_util.make_tensor_proto(np.float32(value)))
    entry.metadata.CopyFrom(scalar_metadata.create_summary_metadata("", description or ""))
    return Summary(value=[entry])


def _setting(value: Any) -> bool | int | float | str:
    # HParams takes bools, numbers and strings; None (e.g. eager off) is a value worth seeing.
    if value is None:
        return "none"
    return value if isinstance(value, bool | int | float | str) else json.dumps(value)


def hparams_summary(config: dict[str, Any], start_time_secs: float) -> Summary:
    """The run's settings for the HParams dashboard (its session start).

    No experiment summary is written: TensorBoard then builds the table from the runs, with each
    setting's type and values (for its filters) and every scalar tag as a metric column, whose
    value is the run's last (its final metrics). Runs whose settings are equal (the seeds of one
    method) get one session group name, a digest of the settings, so the table shows them as one
    row.

    Args:
        config: the run's configuration (``config.json``); keys outside :data:`SETTINGS` are
            left out.
        start_time_secs: the run's start (``time.time()``).
    """
    settings = {k: _setting(config.get(k)) for k in SETTINGS}
    group = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return summary_v2.hparams_pb(settings, trial_id=group, start_time_secs=start_time_secs)


@contextlib.contextmanager
def serve(logdir: str, timeout_s: float = 90.0) -> Iterator[str]:
    """TensorBoard's own server on a free port of 127.0.0.1, for the duration of the ``with``;
    yields its address once it lists every run folder of ``logdir``. The server is ended on
    exit, and on a timeout (its output then goes into the error).

    Args:
        logdir: the folder of runs.
        timeout_s: how long the server may take to start and load the runs.
    """
    with socket.socket() as s:  # a free port; the server binds it a moment later
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    expected = {
        os.path.relpath(d, logdir).replace(os.sep, "/")
        for d, _, files in os.walk(logdir)
        if any(f.startswith("events.out.tfevents.") for f in files)
    }
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--reload_interval", "1"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while expected - set(_runs(url)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(
                        f"TensorBoard did not serve the runs {sorted(expected)} of {logdir} within "
                        f"{timeout_s:g} s ({' '.join(cmd)}):\n{log.read()[-3000:]}"
                    )
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _runs(url: str) -> list[str]:
    try:
        with urllib.request.urlopen(f"{url}/data/runs", timeout=5) as r:
            return list(json.load(r))
    except OSError:  # not listening yet
        return []


def screenshot(
    url: str,
    png: str,
    browser: str = "chromium",
    size: tuple[int, int] = (1600, 1000),
    timeout_s: float = 120.0,
) -> None:
    """A picture of a TensorBoard page, taken by a headless browser (Debian's ``chromium``).

    Args:
        url: the page, e.g. ``f"{address}/#custom_scalars"``.
        png: the file to write.
        browser: the browser's command.
        size: the window's width and height in pixels.
        timeout_s: how long the browser may take.

    Raises:
        RuntimeError: the browser wrote no picture.
    """
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    # Virtual time lets the page's scripts fetch and draw the charts before the picture.
    cmd += [f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=20000"]
    cmd += [f"--screenshot={png}", url]
    if os.path.exists(png):
        os.remove(png)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if not os.path.exists(png):
        raise RuntimeError(f"{' '.join(cmd)} wrote no picture:\n{proc.stderr[-3000:]}")
