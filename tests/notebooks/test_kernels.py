"""nbval's kernels listen on Unix sockets: a TCP port taken by another process in the
window between jupyter_client choosing it and the kernel binding it cannot kill a
notebook run (CI saw it once: "Kernel died before replying to kernel_info" for every
cell of one runbook while the other nbval run and the rest of the suite ran beside it)."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import types
from pathlib import Path

import nbformat
import nbval.kernel
import nbval.plugin
import pytest

from composer_ops import kernels
from tests.notebooks.harness import NOTEBOOKS, hold_first_kernel_port, passed_count, run_nbval

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_port_taken_before_the_kernel_binds_it_cannot_kill_an_nbval_kernel(
        transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The race is forced: the first port jupyter_client hands out is one this test holds.
    # The tcp case is nbval's own kernel manager, and shows the forcing works.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    hold_first_kernel_port(monkeypatch, taken)
    monkeypatch.setattr(nbval.kernel, "KernelManager", nbval.kernel.KernelManager)  # restored afterwards
    if transport == "ipc":
        kernels.use_in_nbval()
    start = nbval.kernel.start_new_kernel
    try:
        if transport == "tcp":
            with pytest.raises(RuntimeError, match="Kernel died"):
                start(kernel_name=nbval.kernel.CURRENT_ENV_KERNEL_NAME, startup_timeout=60,
                      stderr=subprocess.DEVNULL)
            return
        km, kc = start(kernel_name=nbval.kernel.CURRENT_ENV_KERNEL_NAME, startup_timeout=60,
                       stderr=subprocess.DEVNULL)
        try:
            assert km.transport == "ipc"
            reply = kc.execute_interactive("6 * 7", timeout=60)
            assert reply["content"]["status"] == "ok"
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    finally:
        held.close()


def test_the_notebooks_harness_starts_nbval_kernels_on_unix_sockets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("notebooks_conftest", NOTEBOOKS / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    monkeypatch.setattr(nbval.kernel, "KernelManager", nbval.kernel.KernelManager)
    monkeypatch.setattr(nbval.plugin, "nbformat", nbval.plugin.nbformat)
    expect = tmp_path / "expected.json"
    expect.write_text("{}", encoding="utf-8")
    monkeypatch.setenv("COMPOSER_OPS_EXPECT", str(expect))
    config = types.SimpleNamespace(option=types.SimpleNamespace(nbval=False, nbval_lax=True))
    conftest.pytest_configure(config)
    assert nbval.kernel.KernelManager is kernels.UnixSocketKernelManager


def test_nbval_runs_outside_notebooks_use_unix_sockets_too(tmp_path: Path) -> None:
    """tests/notebooks/test_nbval.py runs nbval over copies in a temporary directory, two
    runs side by side, where notebooks/conftest.py is not loaded: the harness's plugin
    (tests/notebooks/unix_kernels.py) gives those kernels Unix sockets too."""
    nb = nbformat.v4.new_notebook()  # type: ignore[no-untyped-call]
    nb.cells = [nbformat.v4.new_code_cell(  # type: ignore[no-untyped-call]
        "from ipykernel.connect import get_connection_info\n"
        "assert get_connection_info(unpack=True)['transport'] == 'ipc'")]
    path = tmp_path / "transport.ipynb"
    nbformat.write(nb, str(path))  # type: ignore[no-untyped-call]
    result = run_nbval([path], {}, rootdir=tmp_path, timeout=170)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and passed_count(output) == 1, output[-3000:]
