"""One container run: private namespaces, the pod's files in place, then the container's command.

    python -S sandbox.py <spec.json>        (standard library only; run by the process kubelet)

This process unshares a mount, UTS and PID namespace, sets the hostname, gives the container a
/dev of its own (a tmpfs with the host's null, zero, random ... bound in, so a termination-log
there never exists on the host), a fresh /run, enters the working directory, and binds what the
spec lists (hosts file, volumes, termination-message file): every source is opened first and
bound through its descriptor, so a volume mounted over /tmp hides no later source (nor this
process's own pid and error files, opened before) that lives under the host's /tmp. Then the
root filesystem is made read-only if the spec says so (`readOnlyRootFilesystem`: the volumes,
/dev, /run and /proc stay writable). Then it forks: the child is PID 1 of the new PID namespace,
mounts its /proc and execs the container's command. This process stays outside, as the
container's supervisor:

- SIGTERM, SIGINT and SIGHUP are forwarded to the container's PID 1 (which, as the init of its
  namespace, gets them only if it handles them, as in a real container);
- when this process dies (SIGKILL from the kubelet, or the kubelet died), the kernel SIGKILLs
  the container's PID 1, and with it every process of the namespace;
- it exits with the container's exit code, 128 + n when signal n killed it.

A command that cannot start leaves its reason in the spec's start_error file and exits 128.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWPID = 0x00020000, 0x04000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x2000, 0x4000, 0x40000
PR_SET_PDEATHSIG = 1
START_FAILED = 128
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str | Path, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    def encode(s: str | Path | None) -> bytes | None:
        return None if s is None else str(s).encode()
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags),
                       encode(data)), f"mount {source} on {target}")


def _make_target(target: Path, is_dir: bool) -> None:
    if is_dir:
        target.mkdir(parents=True, exist_ok=True)
    elif not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()


def bind(source: str, target: str, read_only: bool = False) -> None:
    _make_target(Path(target), Path(source).is_dir())
    mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def open_sources(binds: list[dict]) -> list[int]:
    """The bind sources as O_PATH descriptors: `/proc/self/fd/N` names each one after
    anything has been mounted over its path."""
    return [os.open(b["source"], os.O_PATH) for b in binds]


def bind_all(binds: list[dict], sources: list[int], read_only_root: bool) -> None:
    for b, fd in zip(binds, sources):
        bind(f"/proc/self/fd/{fd}", b["target"], b.get("read_only", False))
        os.close(fd)
    if read_only_root:
        mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def private_dev(staging: Path) -> None:
    """A tmpfs with the host's harmless devices, moved over /dev."""
    staging.mkdir(parents=True, exist_ok=True)
    mount("tmpfs", staging, "tmpfs", MS_NOSUID, "mode=755")
    for name in DEVICES:
        (staging / name).touch()
        mount(f"/dev/{name}", staging / name, None, MS_BIND)
    for name in ("pts", "shm"):  # the host's /dev/shm: torch shares tensors through it
        (staging / name).mkdir()
        mount(f"/dev/{name}", staging / name, None, MS_BIND | MS_REC)
    for name, target in DEV_LINKS.items():
        (staging / name).symlink_to(target)
    mount(str(staging), "/dev", None, MS_MOVE)


def set_up(spec: dict) -> None:
    if spec["cgroup_procs"]:  # the container's CPU limit: its processes are born in the cgroup
        Path(spec["cgroup_procs"]).write_text(str(os.getpid()))
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWPID), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    socket.sethostname(spec["hostname"])
    private_dev(Path(spec["dev_staging"]))
    mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    os.chdir(spec["cwd"])  # before anything is mounted over it
    bind_all(spec["binds"], open_sources(spec["binds"]), spec.get("read_only_root", False))


def _parent_alive(parent_pipe: int) -> bool:
    """The parent holds the pipe's write end open while it lives (getppid() is 0 here)."""
    os.set_blocking(parent_pipe, False)
    try:
        return os.read(parent_pipe, 1) != b""
    except BlockingIOError:
        return True


def run_container(spec: dict, parent_pipe: int, start_error: int) -> None:
    """In the child: PID 1 of the new namespace. Never returns."""
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if not _parent_alive(parent_pipe):
            os._exit(START_FAILED)
        os.close(parent_pipe)
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as e:
        os.write(start_error, f"{spec['argv'][0]}: {e}".encode())
    os._exit(START_FAILED)


def supervise(child: int) -> int:
    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the kubelet's container thread ended
    if os.getppid() != spec["kubelet_pid"]:
        return START_FAILED
    created = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    start_error = os.open(spec["start_error_file"], created)
    pid_file = os.open(spec["pid_file"], created)
    try:
        set_up(spec)
    except OSError as e:
        os.write(start_error, f"setting up the container: {e}".encode())
        return START_FAILED
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(write_end)
        run_container(spec, read_end, start_error)
    os.close(read_end)
    os.write(pid_file, f"{child}\n".encode())
    for fd in (start_error, pid_file):
        os.close(fd)
    return supervise(child)


if __name__ == "__main__":
    sys.exit(main())
