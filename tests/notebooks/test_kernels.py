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

import nbval.kernel
import nbval.plugin
import pytest
from jupyter_client.connect import LocalPortCache

from composer_ops import kernels
from tests.notebooks.harness import NOTEBOOKS

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_port_taken_before_the_kernel_binds_it_cannot_kill_an_nbval_kernel(
        transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The race is forced: every port jupyter_client hands out is one this test holds.
    # The tcp case is nbval's own kernel manager, and shows the forcing works.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    monkeypatch.setattr(LocalPortCache, "find_available_port", lambda self, ip: taken)
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
