"""Worker processes that work wherever regen runs: each is a fresh ``python -m regen.childpool``.

multiprocessing's ``spawn`` and ``forkserver`` make their children re-import the parent's main
module. Inside an Airflow 3 task that module is the ``airflow`` command itself: the child imports
Airflow, which refuses the task supervisor's ``airflow-db-not-allowed:///`` database URL, and
the pool dies with ``BrokenProcessPool`` (a ``fork`` would inherit the tokenizer's threads). A
child started here imports only regen and the function it is told to call, so it behaves the
same under Airflow's LocalExecutor, Celery, an SSH node, pytest and the CLI.

A child reads length-prefixed pickles on its stdin: first ``(initializer, args, function)``
(``module:name`` strings), then one argument tuple per call; it answers each with
``(ok, value, traceback)`` on the descriptor that was its stdout (value: the result, or the
exception, raised again in the parent with the child's traceback as a note). Its own stdout is its stderr, so nothing
a library prints can corrupt the answers.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import traceback
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Callable

from regen.procs import own_python, private_dir

_HEADER = struct.Struct("!Q")


class ChildFailed(RuntimeError):
    """A child's call raised (its traceback in the message) or the child died."""


class OverBudget(ChildFailed):
    """A bounded call passed its time or memory limit."""


def _write(stream: BinaryIO, value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    size, = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def _child_env() -> dict[str, str]:
    """This environment, with regen importable wherever it was found."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _resolve(target: str) -> Callable:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


class _Child:
    def __init__(self, initializer: str, init_args: tuple, function: str, env: dict[str, str]):
        self.proc = subprocess.Popen(own_python("regen.childpool"), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True, cwd=private_dir())
        _write(self.proc.stdin, (initializer, init_args, function))

    def call(self, args: tuple) -> Any:
        try:
            _write(self.proc.stdin, args)
            ok, value, where = _read(self.proc.stdout)
        except (EOFError, BrokenPipeError, OSError):
            code = self.proc.wait()
            raise ChildFailed(f"worker process {self.proc.pid} died (exit status {code}); its "
                              f"messages are in this log above") from None
        if not ok:
            value.add_note(where)
            raise value
        return value

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ChildPool:
    """``workers`` children, each set up once by ``initializer(*init_args)``, then calling
    ``function(*args)`` per :meth:`submit`; a context manager that stops them all."""

    def __init__(self, workers: int, function: str, initializer: str = "regen.childpool:_nothing",
                 init_args: tuple = ()):
        env = _child_env()
        self._children = [_Child(initializer, init_args, function, env) for _ in range(workers)]
        self._idle: queue.Queue[_Child] = queue.Queue()
        for child in self._children:
            self._idle.put(child)
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="childpool")

    def _call(self, args: tuple) -> Any:
        child = self._idle.get()
        try:
            return child.call(args)
        finally:
            self._idle.put(child)

    def submit(self, *args: Any) -> Future:
        return self._threads.submit(self._call, args)

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        for child in self._children:
            child.close()

    def __enter__(self) -> "ChildPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ordered_map(function: Callable, items: Iterable, workers: int, args: tuple = (),
                initializer: Callable | None = None, init_args: tuple = ()) -> Iterator:
    """``function(item, *args)`` of each item, in order: in this process when ``workers`` <= 1,
    else in a :class:`ChildPool` of ``workers`` (``function`` and ``initializer`` named by their
    module and name), at most two items per worker in flight so memory stays bounded."""
    if workers <= 1:
        if initializer is not None:
            initializer(*init_args)
        for item in items:
            yield function(item, *args)
        return

    def name(fn: Callable) -> str:
        return f"{fn.__module__}:{fn.__qualname__}"

    with ChildPool(workers, name(function), name(initializer or _nothing), init_args) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(item, *args))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def call_bounded(function: str, args: tuple, seconds: float, memory_bytes: int) -> Any:
    """``function(*args)`` (``module:name``) in a fresh child held to ``memory_bytes`` of address
    space and ``seconds`` of CPU and of wall time: for work whose size an input decides (a chat
    template from a model folder is a program; it can loop or build a string of gigabytes).
    OverBudget when it passes either; what it raised, raised again here."""
    import math
    import resource

    def limits() -> None:  # in the child, before it runs anything
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        cpu = math.ceil(seconds)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

    # Address space, not resident memory, is what RLIMIT_AS counts: on a node with many cores,
    # a thread pool per core and glibc's arena per thread reserve gigabytes they never touch.
    bounded_env = {**_child_env(), "MALLOC_ARENA_MAX": "2", "RAYON_NUM_THREADS": "2",
                   "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    request = io.BytesIO()
    _write(request, ("regen.childpool:_nothing", (), function))
    _write(request, args)
    proc = subprocess.Popen(own_python("regen.childpool"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=bounded_env, close_fds=True, preexec_fn=limits,
                            cwd=private_dir())
    try:
        out, err = proc.communicate(request.getvalue(), timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise OverBudget(f"took more than {seconds:.0f} s") from None
    budget = f"{seconds:.0f} s of CPU or {memory_bytes / 2**30:.1f} GiB of memory"
    if len(out) < _HEADER.size:  # it died before it could answer
        said = err.decode(errors="replace").strip()
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL) or "MemoryError" in said[-2000:]:
            raise OverBudget(f"stopped past its budget of {budget}")
        raise ChildFailed(f"worker process died (exit status {proc.returncode}): {said[-1500:]}")
    ok, value, where = pickle.loads(out[_HEADER.size:])
    if ok:
        return value
    if isinstance(value, MemoryError):
        raise OverBudget(f"needed more than its budget of {budget}")
    value.add_note(where)
    raise value


def _nothing() -> None:
    return None


def _serve() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what a library prints goes to stderr
    requests = sys.stdin.buffer
    try:
        initializer, init_args, function = _read(requests)
    except EOFError:
        return
    _resolve(initializer)(*init_args)
    call = _resolve(function)
    while True:
        try:
            args = _read(requests)
        except EOFError:
            return
        try:
            answer = (True, call(*args), "")
        except Exception as exc:  # raised again in the parent, as itself where it pickles
            where = f"in worker process {os.getpid()}:\n{traceback.format_exc(limit=8)}"
            try:
                pickle.loads(pickle.dumps(exc))
            except Exception:
                exc = ChildFailed(f"{type(exc).__name__}: {exc}")
            answer = (False, exc, where)
        _write(answers, answer)


# A pool's memory (the audit's and the export's, audit_memory_gb): the main process and each worker
# before a batch (Python, pyarrow, transformers, a tokenizer; ~85 MB measured with the demo's), and
# a batch in a worker as Python objects three times over (its rows, their samples and results, the
# pickles both ways).
MAIN_BASE_BYTES = 600 << 20
WORKER_BASE_BYTES = 250 << 20
BATCH_COPIES = 3
MIN_BATCH_BYTES = 16 << 20


def memory_plan(memory_bytes: float, workers: int) -> tuple[int, int]:
    """(workers, bytes of one batch as Python objects) within ``memory_bytes``: fewer workers than
    asked when their start and a batch each would not fit; the batch as large as what is left allows."""
    spare = max(memory_bytes - MAIN_BASE_BYTES, 0)
    fit = int(spare // (WORKER_BASE_BYTES + BATCH_COPIES * MIN_BATCH_BYTES))
    workers = max(1, min(workers, fit))
    if workers > 1:
        spare -= workers * WORKER_BASE_BYTES
    return workers, max(int(spare // (BATCH_COPIES * workers + 1)), 1)


if __name__ == "__main__":
    _serve()
