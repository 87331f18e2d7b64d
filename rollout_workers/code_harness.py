"""The process that runs a model's program against test inputs, the way verl's prime_code does
(`verl.utils.reward_score.prime_code.testing_util.run_test`, verl 1dda039), for
`rollout_workers/code_tests.py`. Started as `python -I code_harness.py` (standard library only: it
imports nothing of etarl) with the scrubbed environment of a reward process.

It is a fork server (`serve`): each request, {"kind": "stdin" | "call", "program": str, "fn_name": str | None,
"inputs": [str, ...], "timeout_s": int, "folder": str}, is checked in a process forked for it, which
works in `folder` and writes JSON lines to the pipe that came with the request:
  {"ready": true}                       limits and guard set, about to load the program
  {"load_error": why}                   the program did not load (verl's -2): nothing more follows
  {"stdout": text} | {"value": tagged}  the next test's output (stdin kind) or return value (call kind)
  {"error": why}                        the next test raised (verl's -1): nothing more follows
It never sees the expected outputs: the parent compares, so a program that writes to the reply pipe
can only claim outputs it would have to compute anyway. A test that runs past timeout_s ends the
process (SIGALRM, as in verl, whose alarm has no handler).

What verl's harness does to a program, and so this one too: the prelude of star imports, for a stdin
program the trailing `if __name__ == '__main__':` unwrapped and every line but top-level imports moved
into `def code():`, stdin/stdout bound at load to a null device (as in verl's multiprocessing child),
stdin patched per test (input() and sys.stdin read the test's input; readline/read/readlines on the
stdin bound at load return it too, since verl's patches land there), stdout captured, SystemExit
ending a test normally, and verl's `reliability_guard` (exit, quit, os.system, os.fork, subprocess,
... replaced by None: a program calling exit() fails here as it fails there).
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import io
import json
import os
import resource
import signal
import socket
import sys
import types
from unittest import mock

PRELUDE_STAR = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")
PRELUDE_PLAIN = PRELUDE_STAR[:-2]  # builtins and typing are star-imported only
PRELUDE = ("".join(f"from {name} import *\n" for name in PRELUDE_STAR)
           + "".join(f"import {name}\n" for name in PRELUDE_PLAIN) + "sys.setrecursionlimit(6*10**5)\n")
MODULE_NAME = "tmp_sol"  # verl's: a program's __name__ (so a `__main__` block not at its end never runs)
FILE_LIMIT_BYTES = 64 * 2**20  # a file the program writes (its folder is removed after the check)
# What verl's reliability_guard replaces by None (so calling them raises TypeError) and the modules it blocks.
GUARDED = {"builtins": ("exit", "quit", "help"),
           "os": ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork",
                  "forkpty", "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown",
                  "chmod", "chown", "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir"),
           "shutil": ("rmtree", "move", "chown"),
           "subprocess": ("Popen",)}
BLOCKED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter", "subprocess", "ctypes")


def tagged(value):
    """A return value as JSON that keeps what Python's == tells apart and JSON does not: lists, tuples
    and dicts (with their key types) are tagged; bool, int, float, str and None are JSON's own."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):  # a subclass too, as json.dumps writes it (its own text, not its __str__)
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {"d": [[tagged(k), tagged(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"t": [tagged(v) for v in value]}
    return {"l": [tagged(v) for v in value]}  # a list (json.dumps took it, so nothing else is left)


def stdin_program(program: str) -> str:
    """verl's rewrite of a standard-input program: a final `if __name__ == '__main__':` block unwrapped
    (through ast, which also normalises the program's text), then every line that is not a top-level
    import indented by a tab into `def code():`, with stdin and stdout bound first."""
    try:
        tree = ast.parse(program)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            program = ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:  # noqa: BLE001 - as verl: a program ast cannot read is used as it is
        pass
    out, started = [], False
    for line in program.split("\n"):
        is_import = line.startswith(("from ", "import "))
        if not is_import and not started:
            out.append("stdin = sys.stdin\nstdout = sys.stdout\ndef code():\n")
            started = True
        out.append(("\t" if started else "") + line + "\n")
    return "".join(out)


def guard() -> None:
    """verl's reliability_guard: what a program could break the check with is replaced by None."""
    import shutil
    import subprocess

    os.environ["OMP_NUM_THREADS"] = "1"
    for module in (builtins, os, shutil, subprocess):
        for name in GUARDED[module.__name__]:
            setattr(module, name, None)
    for name in BLOCKED_MODULES:
        sys.modules[name] = None


def load(kind: str, program: str, fn_name: str | None):
    """The function a test calls: `code` of the rewritten program, or fn_name of the program (of an
    instance of its Solution class where the program has one, as verl)."""
    source = PRELUDE + (stdin_program(program) if kind == "stdin" else program)
    module = types.ModuleType(MODULE_NAME)
    exec(compile(source, "<string>", "exec"), module.__dict__)
    sys.modules[MODULE_NAME] = module
    if kind == "stdin":
        return module.code
    owner = module.Solution() if "class Solution" in program else module
    return getattr(owner, fn_name)


def int_keys(arguments: list) -> list:
    """verl's undoing of JSON's string keys: a first argument that is a dict becomes the only one, with int
    keys (left as it was where a key is no int)."""
    try:
        if isinstance(arguments[0], dict):
            return [{int(k): v for k, v in arguments[0].items()}]
    except Exception:  # noqa: BLE001
        pass
    return arguments


def run_stdin_test(code, text: str) -> str:
    """What `code()` prints reading `text`. The patches go on in verl's order: read, readlines and
    readline land on the stdin bound at load (the null device), then sys.stdin becomes the input."""
    lines = iter(text.split("\n"))
    captured = io.StringIO()
    captured.close = lambda x: 1  # as verl's Capturing: closing stdout does not drop the output
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch("sys.stdin.read", lambda *args: text))
        patches.enter_context(mock.patch("sys.stdin.readlines", lambda *args: text.split("\n")))
        patches.enter_context(mock.patch("sys.stdin.readline", lambda *args: next(lines)))
        patches.enter_context(mock.patch("sys.stdin", io.StringIO(text)))
        patches.enter_context(mock.patch("builtins.open", mock.mock_open(read_data=text)))
        real_stdout, sys.stdout = sys.stdout, captured
        try:
            code()
        except SystemExit:
            pass
        finally:
            sys.stdout = real_stdout
    return captured.getvalue()


def run_call_test(function, text: str):
    """fn(*arguments) for a test whose input is a JSON value per line; json.dumps must take the result."""
    result = function(*int_keys([json.loads(line) for line in text.split("\n")]))
    json.dumps(result)  # verl fails a test whose return value JSON cannot hold
    return tagged(result)


def check(request: dict, reply_fd: int) -> None:
    """One check, in a process forked for it: the program loaded and run on each input, a JSON line to
    reply_fd for each step (see the module's docstring)."""
    kind, timeout_s = request["kind"], int(request["timeout_s"])
    replies = os.fdopen(reply_fd, "w", encoding="utf-8")

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    os.chdir(request["folder"])
    # The program's stray writes to the real descriptors go nowhere; stdin/stdout/stderr are the null
    # device when it loads, as in verl's child.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    sys.stdin, sys.stdout, sys.stderr = open(os.devnull), open(os.devnull, "w"), open(os.devnull, "w")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cpu_s = timeout_s + 1  # the parent allows timeout_s + 1 wall seconds for all tests: threads cannot burn more
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s if hard == resource.RLIM_INFINITY else min(cpu_s, hard), hard))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT_BYTES, FILE_LIMIT_BYTES))
    if "numpy" in request["program"]:
        import numpy  # noqa: F401 - loaded in verl's harness before its guard (numpy's import calls what it guards)
    guard()
    reply({"ready": True})
    signal.alarm(timeout_s)
    try:
        function = load(kind, request["program"], request.get("fn_name"))
    except BaseException as err:  # noqa: BLE001 - any failure to load is the program's (verl's -2)
        reply({"load_error": repr(err)[:300]})
        return
    signal.alarm(0)
    for text in request["inputs"]:
        signal.alarm(timeout_s)
        try:
            result = {"stdout": run_stdin_test(function, text)} if kind == "stdin" else \
                {"value": run_call_test(function, text)}
        except Exception as err:  # noqa: BLE001 - the program's runtime error (verl's -1)
            reply({"error": repr(err)[:300]})
            return
        signal.alarm(0)
        reply(result)


def _received(control: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = control.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def serve() -> None:
    """The fork server: its stdin is a socket on which each request comes as an 8-byte length, the JSON
    request and (with the length) the write end of a pipe for its replies. Each request is checked in a
    child forked from this process (which has loaded all it needs: a check starts in milliseconds), in
    its own session, whose pid goes back on the socket; the parent ends that session when it is done.
    The server ends when its parent closes the socket."""
    import shutil  # noqa: F401 - what every check imports, loaded once
    import subprocess  # noqa: F401

    for name in PRELUDE_STAR:
        importlib.import_module(name)
    control = socket.socket(fileno=0)
    while True:
        with contextlib.suppress(ChildProcessError):  # the checks the parent has ended
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        try:
            header, fds, _, _ = socket.recv_fds(control, 8, 1)
            if not header:
                return
            header += _received(control, 8 - len(header))
            request = json.loads(_received(control, int.from_bytes(header, "big")))
        except (EOFError, OSError):
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                control.close()
                check(request, fds[0])
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        control.sendall(pid.to_bytes(8, "big"))


if __name__ == "__main__":
    serve()
