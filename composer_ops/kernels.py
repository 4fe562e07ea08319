"""Jupyter kernels that cannot lose a race for a TCP port.

jupyter_client's TCP transport picks five free ports, closes them and lets the kernel
bind them a second later. Any other process taking one of them in that window (two
reports starting together, two nbval runs side by side, any outgoing connection given
that ephemeral port) leaves the kernel with "Address already in use" and the caller
with "Kernel died before replying to kernel_info" before the first cell. On POSIX the
kernels started here talk over Unix sockets (zmq ``ipc``) instead: each kernel's socket
paths are fresh, so nothing can race for them.

Both kernel starters use it: the scheduled reports (papermill,
:class:`composer_ops.reports.ThisPythonKernelManager`) and nbval over the notebooks
(``notebooks/conftest.py`` calls :func:`use_in_nbval`).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

from jupyter_client.localinterfaces import localhost
from jupyter_client.manager import KernelManager
from traitlets import default

#: Longest Unix socket path this module creates (sun_path is 108 bytes on Linux, 104 on macOS).
_MAX_SOCKET_PATH = 100


class UnixSocketKernelManager(KernelManager):
    """A kernel manager whose kernel listens on Unix sockets where the OS has them."""

    @default("transport")
    def _unix_sockets_where_possible(self) -> str:
        return "ipc" if os.name == "posix" else "tcp"

    @default("ip")
    def _private_socket_prefix(self) -> str:
        return kernel_socket_prefix() if self.transport == "ipc" else localhost()


def kernel_socket_prefix() -> str:
    """A fresh path prefix for one kernel's five sockets (``PREFIX-1`` .. ``PREFIX-5``):
    in the Jupyter runtime directory (private to the user), or in the temporary
    directory when that path would be too long for a Unix socket. Either way only
    the user can connect (zmq creates the sockets without write access for others)
    and every message is signed with the kernel's key."""
    from jupyter_core.paths import jupyter_runtime_dir

    name = f"composer-kernel-{uuid.uuid4().hex[:12]}"
    runtime = Path(jupyter_runtime_dir())
    if len(str(runtime / name)) + len("-99") <= _MAX_SOCKET_PATH:
        runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
        return str(runtime / name)
    return str(Path(tempfile.gettempdir()) / name)


def use_in_nbval() -> None:
    """Make nbval start its kernels with :class:`UnixSocketKernelManager` (nbval builds
    a plain ``KernelManager`` in ``nbval.kernel.start_new_kernel``; its kernelspec
    manager is still passed explicitly, so ``--nbval-current-env`` keeps working)."""
    import nbval.kernel

    nbval.kernel.KernelManager = UnixSocketKernelManager
