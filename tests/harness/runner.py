"""Launch the demo training script under torchrun and the CLI in a subprocess, as the tests need it.

The demo's own runner (``deepspeed_ext.demo.runner``) does what the demo needs; this one adds what only tests
use: another Python environment (another DeepSpeed release) per run, failures returned instead of raised, and
the fp16 loss scales a run recorded.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from deepspeed_ext.demo import runner as demo_runner
from deepspeed_ext.demo.runner import read_losses
from harness.workers.pool_claim import claim, make_wake_channels, wake

#: The demo training script plus the probes (state dumps, loss scales) tests read.
TRAIN_WORKER = Path(__file__).parent / "workers" / "train.py"
#: The CLI, stopped by a signal it sends itself at a named point of a conversion.
STOPPED_CLI_WORKER = Path(__file__).parent / "workers" / "stopped_cli.py"
#: The CLI's commands, each in a child forked from a process that imported torch once (``cli``).
CLI_SERVER_WORKER = Path(__file__).parent / "workers" / "cli_server.py"
#: torchrun's workers, each forked from a process that imported torch, DeepSpeed and transformers once
#: (``zygote_workers``), and what torchrun runs in their place.
ZYGOTE_WORKER = Path(__file__).parent / "workers" / "zygote.py"
ZYGOTE_LAUNCH = Path(__file__).parent / "workers" / "zygote_launch.py"
#: The workers the zygote forks: those that build a DeepSpeed engine, and so import DeepSpeed and transformers
#: anyway. Others (the CLI under torchrun, a weight receiver) start afresh: what deepspeed-ext does depends on
#: whether DeepSpeed is imported (``serialization.allowed_globals``), and those never import it.
ZYGOTE_SCRIPTS = {"train.py", "hf_trainer.py", "accelerate_loop.py", "compare_tags.py", "lora_autotp_edges.py",
                  "one_rank.py", "receive_into_engine.py", "save_and_exit.py", "stream_weights.py",
                  "tp_plan_family.py", "deepspeed_ext.demo.train", "deepspeed_ext.demo.pipeline",
                  # docs/trainers.md's scripts, run as written (tests/e2e/test_trainers.py)
                  "train_trainer.py", "train_accelerate.py"}

__all__ = ["child_env", "cli", "cli_stopped", "read_loss_scales", "read_losses", "run_logged", "torchrun_nodes",
           "torchrun_train", "torchrun_train_runs", "zygote_workers"]


def child_env(python: str = sys.executable) -> dict[str, str]:
    env = demo_runner.child_env()
    # DeepSpeed's Muon torch.compiles its Newton-Schulz step; on the CPU each new process compiles it again, 78 s of
    # a 13 s training run. No test is about compilation: the same code runs eagerly.
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    if python != sys.executable:
        # Another environment (another DeepSpeed): its JIT-built ops in its own cache, where scripts/setup.sh
        # builds them, not in ours (inherited from this process). The venv's python is a symlink: not resolved.
        env["TORCH_EXTENSIONS_DIR"] = str(Path(python).absolute().parents[1] / "torch_extensions")
        # and its own compiler (ccache standing in for c++), which its .pth sets: the command lines its ops were
        # built with (scripts/setup.sh), so that ninja finds them up to date.
        env.pop("CXX", None)
        # Its modules' bytecode is kept once compiled (tests/e2e/test_install.py installs without compiling: a
        # machine that sets PYTHONDONTWRITEBYTECODE would compile torch again in every process).
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _timed(kind: str, what: str, started: float) -> None:
    """With ``DSX_TEST_TIMING_LOG=FILE``: one line per subprocess the tests ran (``kind``: pool-start, pooled,
    torchrun, cli, run), its seconds and what it was, appended to FILE (the suite's time, by where it goes)."""
    import time
    path = os.environ.get("DSX_TEST_TIMING_LOG")
    if path:
        with open(path, "a") as out:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            out.write(f"{os.getpid()}\t{kind}\t{time.monotonic() - started:.2f}\t{what[:200]}\t{test}\n")


def run_logged(cmd: list[str], log: Path, check: bool = True, cwd: Path | None = None,
               extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``cmd[0]`` is the Python to use) with its output in ``log``; on failure raise with the tail,
    or with ``check=False`` return the failed process. ``extra_env``: set on top of :func:`child_env`'s."""
    import time
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    launched, env = zygote_workers(cmd, {**child_env(cmd[0]), **(extra_env or {})})
    proc = subprocess.run(launched, env=env, capture_output=True, text=True, timeout=demo_runner.TIMEOUT_S, cwd=cwd)
    proc.args = cmd  # the command as the test wrote it, in its log and errors
    _timed("torchrun" if "torch.distributed.run" in cmd else "run", " ".join(Path(c).name for c in cmd[1:8]), started)
    return _logged(proc, log, check)


def _logged(proc: subprocess.CompletedProcess, log: Path, check: bool) -> subprocess.CompletedProcess:
    """``proc``'s command and output written to ``log``; with ``check``, raise with the tail if it failed."""
    cmd = " ".join(proc.args)
    log.write_text(f"$ {cmd}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}), log {log}: {cmd}\n"
                           + _failure_tail(proc.stdout + proc.stderr))
    return proc


def _failure_tail(output: str, lines: int = 40) -> str:
    """The last ``lines`` lines the command's own code printed. torchrun's agent ends a failed run with its own
    traceback and report (which name the exit signal, not the cause); those are cut so the workers' last words
    show."""
    kept = output.splitlines()
    for i, line in enumerate(kept):
        if "torch/distributed/elastic/multiprocessing/api.py" in line and "failed (exitcode" in line:
            kept = kept[:i + 1]
            break
    return "\n".join(kept[-lines:])


def torchrun_train(nproc: int, args: list[str], log: Path, python: str = sys.executable,
                   check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N workers/train.py ARGS`` (the demo's training script with the
    tests' probes; gloo on CPU) in ``python``'s environment; ``check=False`` returns a failed run.

    A run expected to succeed, in this environment, goes to a pool of torchrun workers kept for its rank count
    (``_pool_for``): a fresh model and engine in processes that have imported torch, DeepSpeed and transformers
    once, which is most of a tiny run's time. Its output is in ``log`` as a fresh run's would be."""
    pool = _pool_for(nproc, [args], python, check)
    if pool is not None:
        return _pooled(pool, [args], log)
    return run_logged([python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                       str(TRAIN_WORKER), *args], log, check=check)


def torchrun_train_runs(nproc: int, runs: list[list[str]], log: Path, python: str = sys.executable) -> None:
    """Several runs of workers/train.py expected to succeed: one request to their pool, one after the other in its
    processes (a fresh model and engine each), output in ``log``; where they cannot be pooled (``_pool_for``), a
    torchrun each, run I's output in ``log`` with ``.I`` before its suffix."""
    pool = _pool_for(nproc, runs, python, True)
    if pool is not None:
        _pooled(pool, runs, log)
        return
    for index, args in enumerate(runs):
        torchrun_train(nproc, args, log if len(runs) == 1 else log.with_suffix(f".{index}{log.suffix}"),
                       python=python)


def torchrun_nodes(nproc_per_node: int, runs: list[list[str]], log: Path, check: bool = True,
                   extra_env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """One job over several nodes on this machine: a torchrun agent per node (``runs[i]``: node i's arguments to
    workers/train.py, so each node may name directories of its own, as ranks on other hosts see other disks), with
    a static rendezvous on localhost. Node i's output in ``log`` with ``.nodeI`` before its suffix; with ``check``,
    raises with the tail of the first node that failed."""
    import socket
    import time
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log.parent.mkdir(parents=True, exist_ok=True)
    started, procs = time.monotonic(), []
    for node, args in enumerate(runs):
        cmd, env = zygote_workers(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(runs)}", f"--node_rank={node}",
             f"--nproc_per_node={nproc_per_node}", "--master_addr=127.0.0.1", f"--master_port={port}",
             str(TRAIN_WORKER), *args], {**child_env(), **(extra_env or {})})
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for node, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=demo_runner.TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        done.append(_logged(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                            log.with_suffix(f".node{node}{log.suffix}"), check))
    _timed("torchrun", f"{len(runs)} nodes", started)
    return done


#: The pid of the test process that owns a pool: its ranks leave once that process is gone, however it ended (an
#: xdist worker killed at the end of a run never runs its exit handlers).
OWNER_ENV = "DSX_TEST_POOL_OWNER"


class PoolReleased(Exception):
    """A pool that left while idle (the machine short of memory) before this run could claim it."""


class _TrainPool:
    """``torchrun ... workers/train.py --serve DIR``: ``nproc`` ranks kept for runs at any TP degree (the ranks
    drop DeepSpeed's TP groups before a run at another one), each run a fresh model and engine. Requests and answers are files in DIR
    (see ``serve`` there). A run that fails ends the pool; the next run starts a new one."""

    def __init__(self, nproc: int, key: tuple) -> None:
        import tempfile
        import time
        self.started = time.monotonic()
        self.nproc, self.key, self.requests = nproc, key, 0
        self.directory = Path(tempfile.mkdtemp(prefix="train_pool_"))
        make_wake_channels(self.directory, nproc)
        # torchrun's agent looks at its workers (and asks the rendezvous store) 10 times a second by default, for
        # the pool's whole life; once a second is soon enough to end a pool whose rank failed.
        cmd, env = zygote_workers([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={nproc}", "--monitor-interval=1", str(TRAIN_WORKER), "--serve",
                                   str(self.directory)],
                                  {**child_env(), OWNER_ENV: str(os.getpid())})
        with open(self.directory / "pool.log", "w") as own_log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=own_log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, runs: list[list[str]], log: Path) -> subprocess.CompletedProcess:
        import time
        number, self.requests = self.requests, self.requests + 1
        if not claim(self.directory, number):  # it left while idle, the machine short of memory (train.py's serve)
            raise PoolReleased(str(self.directory))
        log.parent.mkdir(parents=True, exist_ok=True)
        command = f"torchrun --nproc_per_node={self.nproc} {TRAIN_WORKER} (pooled, {self.directory} #{number})"
        log.write_text("".join(f"$ {command} {' '.join(args)}\n" for args in runs) + "--- output\n")
        staging = self.directory / f"{number}.json.partial"
        staging.write_text(json.dumps({"runs": runs, "log": str(log.absolute())}))
        staging.rename(self.directory / f"{number}.json")
        wake(self.directory)
        started = time.monotonic()
        done, deadline = self.directory / f"{number}.done", time.monotonic() + demo_runner.TIMEOUT_S
        while not done.exists():
            if not self.alive() or time.monotonic() > deadline:
                why = "timed out" if self.alive() else f"ended ({self.proc.returncode})"
                own_log = _failure_tail((self.directory / "pool.log").read_text(), 15)  # before close removes it
                self.close()
                _POOLS.pop(self.key, None)
                raise RuntimeError(f"pooled run {why}, log {log}:\n" + _failure_tail(log.read_text()) +
                                   "\n--- the pool's torchrun:\n" + own_log)
            time.sleep(0.05)
        if number == 0:  # the pool's start (processes, imports) and its first run, whose lazy imports it pays
            _timed("pool-start", f"{self.key}", self.started)
        else:
            _timed("pooled", f"{self.key} {' '.join(runs[0][:4])}", started)
        output = log.read_text()
        return subprocess.CompletedProcess(args=command, returncode=0, stdout=output, stderr="")

    def close(self) -> None:
        """Ask the ranks to leave; kill them (torchrun starts them in sessions of their own) if they do not."""
        (self.directory / "stop").write_text("")
        wake(self.directory)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for pid_file in self.directory.glob("pid.*"):
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


#: This test process's pools, by (ranks, fp16 allowed on CPU), the most recently used last.
_POOLS: dict[tuple, _TrainPool] = {}
#: At most this many pooled ranks alive per test process (each holds torch, DeepSpeed and transformers).
POOLED_RANKS = 10


def _pooled(pool: _TrainPool, runs: list[list[str]], log: Path) -> subprocess.CompletedProcess:
    """``pool.run``; where the pool has left meanwhile (idle while memory ran short), on a new pool of its kind,
    started as any other (``_pool_for``)."""
    try:
        return pool.run(runs, log)
    except PoolReleased:
        _POOLS.pop(pool.key, None)
        pool.close()
        fresh = _pool_for(pool.nproc, runs, sys.executable, True)
        assert fresh is not None  # the runs were pooled a moment ago
        return fresh.run(runs, log)


def _pool_for(nproc: int, runs: list[list[str]], python: str, check: bool) -> _TrainPool | None:
    """The pool for these runs, started if need be, or None where they need a process of their own: another
    environment, a run expected to fail (it ends its processes), a run measuring its own process (``--timing``),
    or pooling turned off (``DSX_TEST_FRESH_PROCESSES=1``)."""
    if python != sys.executable or not check or os.environ.get("DSX_TEST_FRESH_PROCESSES") == "1":
        return None
    if any("--timing" in args or "--tp" not in args for args in runs):
        return None
    # AutoEP runs share the pools: DeepSpeed's AutoEP retargets transformers' output recorders per model instance
    # (the class-wide registry is restored once the hooks are in), so a later run of the family meets nothing left.
    # Runs at every TP degree share them too: a rank drops DeepSpeed's TP groups before a run at another degree
    # (workers/train.py).
    key = (nproc, any("--allow-cpu-fp16" in args for args in runs))
    pool = _POOLS.pop(key, None)
    if pool is not None and not pool.alive():
        pool.close()  # its directory (it left on its own, or failed)
    if pool is None or not pool.alive():
        while _POOLS and sum(p.nproc for p in _POOLS.values()) + nproc > POOLED_RANKS:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = _TrainPool(nproc, key)
    _POOLS[key] = pool
    return pool


@atexit.register
def close_pools() -> None:
    """End this process's pools and CLI server (at the end of the test session, and at exit whatever ended the
    session)."""
    global _CLI_SERVER
    while _POOLS:
        _POOLS.popitem()[1].close()
    if _CLI_SERVER is not None:
        _CLI_SERVER.close()
        _CLI_SERVER = None
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].close()


class _Zygote:
    """``workers/zygote.py`` in ``python``'s environment: forks torchrun's workers for this test process from a
    process that imported torch, DeepSpeed and transformers once (``zygote_workers``)."""

    def __init__(self, python: str = sys.executable) -> None:
        import tempfile
        import time
        self.directory = Path(tempfile.mkdtemp(prefix="zygote_"))
        self.socket = self.directory / "socket"
        with open(self.directory / "zygote.log", "w") as own_log:
            self.proc = subprocess.Popen([python, str(ZYGOTE_WORKER), str(self.socket)], env=child_env(python),
                                         stdin=subprocess.DEVNULL, stdout=own_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.socket.exists() and self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # it listens before it imports: launchers that come meanwhile wait in its backlog

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


#: This test process's zygotes, by the Python (environment) they run in.
_ZYGOTES: dict[str, _Zygote] = {}


def zygote_workers(cmd: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``cmd`` and its environment, with torchrun's workers (where ``cmd`` is ``PYTHON -m torch.distributed.run
    ... SCRIPT|-m MODULE ARGS``, SCRIPT one of ``ZYGOTE_SCRIPTS``) forked by this test process's zygote for that
    Python (DeepSpeed 0.18.8's environment has its own) instead of started afresh (workers/zygote.py: a worker's
    imports are most of a tiny run). The same scripts run, with the same arguments, environment and output; a
    worker the zygote cannot stand in for (an environment that differs) starts afresh, and
    ``DSX_TEST_FRESH_PROCESSES=1`` starts every worker afresh."""
    if "torch.distributed.run" not in cmd[:3] or os.environ.get("DSX_TEST_FRESH_PROCESSES") == "1":
        return cmd, env
    from torch.distributed.run import get_args_parser
    start = cmd.index("torch.distributed.run") + 1
    options = get_args_parser().parse_args(cmd[start:])
    position = len(cmd) - len(options.training_script_args) - 1
    if (options.no_python or cmd[position] != options.training_script
            or Path(options.training_script).name not in ZYGOTE_SCRIPTS):
        return cmd, env
    head, script = cmd[:position], [options.training_script]
    if options.module:  # torchrun's own -m, before the module: the launcher is the script now, and takes it
        head = cmd[:start] + [arg for arg in cmd[start:position] if arg not in ("-m", "--module")]
        script = ["-m", options.training_script]
    zygote = _ZYGOTES.get(cmd[0])
    if zygote is None or not zygote.alive():
        if zygote is not None:
            zygote.close()
        zygote = _ZYGOTES[cmd[0]] = _Zygote(cmd[0])
    return ([*head, str(ZYGOTE_LAUNCH), *script, *options.training_script_args],
            {**env, "DSX_TEST_ZYGOTE": str(zygote.socket)})


def cli(args: list[str], log: Path, check: bool = True, python: str = sys.executable) -> subprocess.CompletedProcess:
    """``deepspeed-ext ARGS`` in a subprocess of ``python``'s environment: in this environment, a child forked by
    this test process's CLI server (``_CliServer``), which has imported torch once; with
    ``DSX_TEST_FRESH_PROCESSES=1``, or an environment that differs from the server's in what torch reads as it is
    imported, a fresh ``python -m deepspeed_ext``."""
    if python != sys.executable or os.environ.get("DSX_TEST_FRESH_PROCESSES") == "1":
        return run_logged([python, "-m", "deepspeed_ext", *args], log, check=check)
    global _CLI_SERVER
    env = child_env()
    if _CLI_SERVER is None or not _CLI_SERVER.serves(env):
        if _CLI_SERVER is not None:
            _CLI_SERVER.close()
        _CLI_SERVER = _CliServer(env)
    log.parent.mkdir(parents=True, exist_ok=True)
    return _logged(_CLI_SERVER.run(args, env), log, check)


#: What differs between two requests to the CLI server without mattering to what its imports read: pytest's
#: name of the running test.
_VOLATILE_ENV = {"PYTEST_CURRENT_TEST"}


class _CliServer:
    """``workers/cli_server.py``: forks a child per command from a process that imported torch, numpy and the CLI
    once (most of a small command's time). The child is a fresh ``python -m deepspeed_ext`` in every other way:
    its own argv, environment, directory, stdout and stderr, exit code and exit handlers."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = self._steady(env)
        self.proc = subprocess.Popen([sys.executable, str(CLI_SERVER_WORKER)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    @staticmethod
    def _steady(env: dict[str, str]) -> dict[str, str]:
        return {key: value for key, value in env.items() if key not in _VOLATILE_ENV}

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a command in ``env`` may run here: torch read its environment once, as this server started."""
        return self.proc.poll() is None and self._steady(env) == self.env

    def run(self, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        """``deepspeed-ext ARGS`` in ``env``, as ``subprocess.run`` with its output captured returns it."""
        import tempfile
        import time
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="cli_") as scratch:
            out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
            request = {"argv": args, "env": env, "stdout": str(out), "stderr": str(err)}
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._answer(30)["pid"]
            try:
                returncode = self._answer(demo_runner.TIMEOUT_S)["returncode"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self.close()
                raise subprocess.TimeoutExpired(["deepspeed-ext", *args], demo_runner.TIMEOUT_S) from None
            _timed("cli", " ".join(args[:1]), started)
            return subprocess.CompletedProcess([sys.executable, "-m", "deepspeed_ext", *args], returncode,
                                               out.read_text(), err.read_text())

    def _answer(self, timeout: float) -> dict:
        import selectors
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("the CLI server ended (tests/harness/workers/cli_server.py)")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_CLI_SERVER: _CliServer | None = None


def cli_stopped(args: list[str], log: Path, *, point: str, count: int,
                sig: signal.Signals = signal.SIGKILL) -> subprocess.CompletedProcess:
    """``deepspeed-ext ARGS`` in a subprocess that sends itself ``sig`` the ``count``-th time the conversion
    reaches ``point`` (workers/stopped_cli.py: ``range-read``). Raises unless it was stopped there: a conversion
    that finished first, or ended any other way, would test nothing."""
    proc = run_logged([sys.executable, str(STOPPED_CLI_WORKER), point, str(count), sig.name, "--", *args], log,
                      check=False)
    if f"stopped at {point} #{count}" not in proc.stdout:
        raise AssertionError(f"deepspeed-ext {' '.join(args)} never reached {point} #{count} (exit "
                             f"{proc.returncode}; log {log}):\n{_failure_tail(proc.stdout + proc.stderr)}")
    return proc


def the_one_save_failure(output: str) -> str:
    """The one ``CheckpointError`` line a failed run's ranks raised (asserting they all raised the same one,
    and at least two of them said it)."""
    reasons = {line.split("CheckpointError: ", 1)[1] for line in output.splitlines() if "CheckpointError: " in line}
    assert len(reasons) == 1, output[-3000:]
    (reason, ) = reasons
    assert output.count(reason) >= 2, output[-3000:]  # every rank said it
    return reason


def read_loss_scales(path: Path) -> dict[int, float | None]:
    """Per step, the fp16 loss scale the run ended the step with (None without loss scaling)."""
    return {int(step): scale for step, scale in json.loads(path.read_text()).get("loss_scales", {}).items()}
