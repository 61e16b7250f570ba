"""tests/gpu/: operator checks that need an sm90 GPU, marked `gpu` (the skip elsewhere is in
tests/conftest.py). On the H200: `python -m pytest -m gpu tests/gpu` (kernels from a bundle,
$FORGEKERNEL_KERNEL_DIR, or compiled on first use; naming the folder keeps a host without the
DSL from collecting the CPU tests that import it).

Each failure is written to the terminal as it happens: `FAILED <nodeid>: <reason>` and the last
lines of its traceback, flushed. `-q` shows a failure only as an `F` until the summary at the end,
and a run cut by its time limit has no end (2026-12-02 10:20: killed after 239 of 633 tests, its
38 failures known only as `F`s, mapped to tests by collection order)."""

from __future__ import annotations

import sys

import pytest

EXCERPT = 15  # traceback lines kept per failure (the full one is in pytest's summary, if it ends)
_CONFIG: list[pytest.Config] = []  # set by pytest_configure: hooks of a report have no config


def failure_lines(report: pytest.TestReport) -> list[str]:
    """`FAILED <nodeid>: <reason>` (the phase named when it is not the test's call), then the
    traceback's last lines, indented."""
    text = report.longreprtext.rstrip()
    crash = getattr(report.longrepr, "reprcrash", None)
    reason = crash.message.strip() if crash is not None else ""
    reason = (reason or text or "?").splitlines()[0 if reason else -1].strip()[:200]
    phase = "" if report.when == "call" else f"(in {report.when}) "
    return [f"FAILED {report.nodeid}: {phase}{reason}"] + [
        f"    | {line}" for line in text.splitlines()[-EXCERPT:]
    ]


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG[:] = [config]


@pytest.hookimpl(trylast=True)  # after the reporter's own `F`
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed:
        return
    text = "\n".join(failure_lines(report)) + "\n"
    reporter = _CONFIG[0].pluginmanager.get_plugin("terminalreporter") if _CONFIG else None
    if reporter is not None:  # the progress's stream, in order with it; -q's line of dots ended
        reporter.write("\n" + text, flush=True)
    else:
        sys.stderr.write(text)
        sys.stderr.flush()
