"""Hugging Face `transformers.Trainer` and TRL (`SFTTrainer`, `GRPOTrainer`, ...) through otel-rl.

::

    from otel_rl.integrations.transformers import OtelRLCallback, trace_rewards

    trainer = GRPOTrainer(model=model, args=GRPOConfig(..., report_to="none"),
                          reward_funcs=trace_rewards([accuracy, format_ok]),    # optional: rollout traces
                          callbacks=[OtelRLCallback(exporters=["mlflow"], trace_backend="mlflow")],
                          train_dataset=ds, processing_class=tok)
    trainer.train()

`OtelRLCallback` is a `transformers.TrainerCallback` and uses only otel-rl's public API:

- **Run identity.**  When otel-rl is not initialised yet, the first event starts it with the keyword
  arguments given to the callback; the experiment name defaults to ``args.run_name`` (else the last
  part of ``args.output_dir``) and the run config is ``args.to_dict()``.  The environment
  (``OTEL_RL_*``) is read as ``otel_rl.init`` reads it and wins over what comes from the arguments.
  Under ``torch.distributed`` every process gets rank 0's run id (one collective at train begin).
  A pipeline already started by the program is used as it is and left running.
- **Metrics.**  Every ``on_log`` of the main process becomes ``otel_rl.log(entry, step=state.global_step)``
  where ``entry`` is the record the trainer has just appended to ``state.log_history`` (without its
  ``step``): the trainer's own names and values.  Values that are not numbers (TRL writes ``None`` for a
  reward that was never applicable) are left out.  Other processes log nothing, as the Trainer does.
- **Steps.**  One ``rl.step`` span per optimizer step, numbered as the step's ``global_step`` after it
  (the number its metrics are logged at), from ``on_step_begin`` to ``on_step_end``: generation,
  rewards, forward, backward and the optimizer step fall inside it.  Every process traces.
- **Evaluation.**  An ``evaluate`` span ending at ``on_evaluate`` and lasting the trainer's measured
  ``*_runtime``; the ``eval_*`` metrics come through ``on_log`` like the others.
- **End of training.**  The trainer's closing record (``train_runtime``, ``train_loss``, ...) is logged at
  the last step and the pipeline is flushed; it stays open (a later ``evaluate()`` joins the same run) and
  is shut down at exit, or by ``otel_rl.shutdown()``.

`trace_rewards` wraps GRPO reward functions: after the reward functions of a batch have run, each
completion becomes one trajectory trace (see `RewardTracer`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import otel_rl
from otel_rl import semconv as sc

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "otel_rl.integrations.transformers needs the `transformers` package (pip install 'transformers>=5.5.3')"
    ) from exc

__all__ = ["OtelRLCallback", "RewardTracer", "trace_rewards", "OVERLAPPING_REPORTERS"]

_log = logging.getLogger("otel_rl")

#: the reward functions `trace_rewards` is given (one, or a list or tuple of them): given back in the same shape
T = TypeVar("T")

#: `report_to` integrations of transformers that write to a tracker otel-rl also serves
OVERLAPPING_REPORTERS = {"mlflow": "mlflow", "wandb": "wandb", "swanlab": "swanlab"}

#: the optimizer step currently open in any callback (the step reward functions run in; they may run on
#: TRL's asyncio thread, where the callback's context variables are not set)
_open_step: list[int | None] = [None]
# the callback whose step is open: a reward function's error leaves the training step (and trainer.train())
# without on_step_end, so the step ends with that error (otherwise it would stay the current span)
_stepping: list[Any] = [None]
#: where this process's completions sit in the whole generation batch, from the trainer's arguments:
#: (process index, number of processes, completions per prompt in training, ... in evaluation); None
#: without the callback
_layout: list[tuple[int, int, int | None, int | None] | None] = [None]
#: batches numbered per (step, validate) kept at most (evaluation scores several batches at one step)
_BATCHES_KEPT = 16


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) or (hasattr(v, "item") and getattr(v, "ndim", 1) == 0)


class OtelRLCallback(TrainerCallback):
    """Training metrics, optimizer steps and evaluations of a `transformers.Trainer` in otel-rl.

    Keyword arguments are `otel_rl.init` settings (``exporters``, ``project``, ``trace_backend``,
    ``max_samples``, ...), used only when this callback starts otel-rl.  ``config`` (a dict) is logged as
    the run config instead of ``args.to_dict()``.
    """

    def __init__(self, config: dict[str, object] | None = None, **settings: object):
        self._config = config
        self._settings = settings
        self._owned = False
        self._step: Any = None  # the open otel_rl.step block
        self._warned_overlap = False

    # -- setup ------------------------------------------------------------------------------
    def _ensure(self, args: Any, state: Any, model: Any = None) -> Any:
        h = otel_rl.current()
        if h is not None and not h.closed:
            return h
        settings: dict[str, Any] = dict(self._settings)
        if "experiment" not in settings and not os.environ.get("OTEL_RL_EXPERIMENT"):
            name = getattr(args, "run_name", None) or os.path.basename(
                os.path.normpath(os.path.abspath(getattr(args, "output_dir", None) or "trainer"))
            )
            settings["experiment"] = str(name)
        if "run_id" not in settings and not os.environ.get(sc.ENV_RUN_ID):
            shared = _shared_run_id()
            if shared:
                settings["run_id"] = shared
        config = self._config
        if config is None:
            config = _args_dict(args)
            model_config = getattr(model, "config", None)
            if model_config is not None and hasattr(model_config, "to_dict"):
                try:
                    config = {**config, "model_config": model_config.to_dict()}
                except Exception:
                    pass
        h = otel_rl.init(config, **settings)
        self._owned = True
        return h

    def _check_report_to(self, args: Any, handle: Any) -> None:
        if self._warned_overlap:
            return
        self._warned_overlap = True
        report_to = getattr(args, "report_to", None) or []
        if isinstance(report_to, str):
            report_to = [report_to]
        ours = {getattr(e, "name", None) for e in getattr(handle, "exporters", ())}
        both = sorted(r for r in report_to if OVERLAPPING_REPORTERS.get(r) in ours)
        if both:
            _log.warning(
                "otel-rl: report_to=%s and otel-rl's exporters both write to %s: each metric is logged "
                "twice (set report_to='none' to let otel-rl do it alone)",
                list(report_to),
                ", ".join(both),
            )

    # -- events -----------------------------------------------------------------------------
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        _note_layout(args)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: object = None,
        **kwargs: object,
    ) -> None:
        _note_layout(args)
        try:
            h = self._ensure(args, state, model)
            self._check_report_to(args, h)
        except (otel_rl.ConfigError, otel_rl.UnknownExporterError):
            raise  # a wrong setting given to the callback: said before training starts, not lost quietly
        except Exception as exc:
            _log.warning("otel-rl: could not start (%s); training goes on without telemetry", exc)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._close_step(None)
        if otel_rl.current() is None:
            return
        n = int(state.global_step) + 1
        try:
            block = otel_rl.step(n)
            block.__enter__()
        except Exception:
            return
        self._step = block
        _open_step[0] = n
        _stepping[0] = self

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._close_step(None)

    def _close_step(self, exc: BaseException | None) -> None:
        block, self._step = self._step, None
        _open_step[0] = None
        if _stepping[0] is self:
            _stepping[0] = None
        if block is not None:
            try:
                block.__exit__(type(exc) if exc else None, exc, None)
            except Exception:
                pass

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: object,
    ) -> None:
        if not state.is_world_process_zero:
            return
        h = otel_rl.current()
        if h is None or h.closed:
            try:
                h = self._ensure(args, state, kwargs.get("model"))
            except Exception:
                return
        history = state.log_history
        entry = history[-1] if history and history[-1].get("step") == state.global_step else None
        if entry is None or (logs and any(k not in entry for k in logs)):
            entry = logs or {}
        data = {k: v for k, v in entry.items() if k != "step" and _number(v)}
        if data:
            h.log(data, step=state.global_step)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: object,
    ) -> None:
        h = otel_rl.current()
        if h is None or h.closed or not h.tracing:
            return
        runtime = next((v for k, v in (metrics or {}).items() if k.endswith("_runtime") and _number(v)), 0.0)
        end = time.time_ns()
        try:
            span = h.tracer.start_span(
                "evaluate",
                start_time=end - int(float(runtime) * 1e9),
                attributes={
                    sc.RL_STEP: int(state.global_step),
                    sc.RL_SPAN_KIND: sc.KIND_TIMER,
                    sc.RL_TIMER_NAME: "evaluate",
                    sc.RL_VALIDATE: True,
                },
            )
            span.end(end_time=end)
        except Exception:
            pass

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._close_step(None)
        otel_rl.flush()


def _end_step_in(exc: BaseException) -> None:
    """End the open training step with `exc`, the error that leaves it (see `_stepping`)."""
    callback = _stepping[0]
    if callback is not None:
        callback._close_step(exc)


def _note_layout(args: Any) -> None:
    """Keep what `RewardTracer` needs to number completions across processes (see `_layout`)."""
    try:
        g = getattr(args, "num_generations", None)
        g_eval = getattr(args, "num_generations_eval", None) or g
        _layout[0] = (
            int(getattr(args, "process_index", 0) or 0),
            max(1, int(getattr(args, "world_size", 1) or 1)),
            int(g) if g else None,
            int(g_eval) if g_eval else None,
        )
    except Exception:
        _layout[0] = None


def _args_dict(args: Any) -> dict:
    try:
        d = args.to_dict()
    except Exception:
        return {}
    return {k: v for k, v in d.items() if not k.startswith("_")}


def _shared_run_id() -> str | None:
    """Rank 0's run id for every process of a `torch.distributed` job (None outside one)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        import uuid

        box = [uuid.uuid4().hex[:16] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    except Exception as exc:
        _log.warning("otel-rl: could not share the run id between processes (%s); set OTEL_RL_RUN_ID", exc)
        return None


# ----------------------------------------------------------------------------- GRPO reward functions

_REWARD_KWARGS_SKIPPED = ("trainer_state", "log_extra", "log_metric", "environments")


_replaying = threading.local()  # the score (or exception) a `reward <name>` span is replaying


def _score(prompt: Any, completion: Any) -> Any:
    outcome = _replaying.value
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


class RewardTracer:
    """Turns the batches scored by a group of reward functions into one trajectory per completion.

    TRL calls every reward function once per generation batch with the same ``prompts`` and
    ``completions`` lists.  When the last function of the group has scored a batch (or one has raised),
    each completion becomes a trajectory ``grpo.completion`` with:

    - ``rl.step``: the optimizer step the batch was generated in (``OtelRLCallback``'s open step); outside
      a training step (evaluation) ``trainer_state.global_step`` and ``rl.validate=true``;
    - ``rl.sample_index``: the prompt's group in the step's generation batch over all processes and
      ``rl.rollout_n``: the completion's place in its group (see `_groups`);
    - a child ``completion`` span (LLM) with the prompt as input and ``{"completion", "response_ids"}``
      as output, and one ``reward <name>`` span (REWARD) per function with the prompt and completion as
      input and the function's score as output, or its exception;
    - ``rl.reward`` on the root: the sum of the scores (TRL's ``reward_weights`` are not passed to
      reward functions; ``None`` scores are left out).

    Samples are chosen with `otel_rl.select_samples` (``max_samples``: deterministic); a batch whose reward
    function raised is kept whole, as errors, and the exception goes on to TRL unchanged.  These spans
    carry the data of the batch; their durations are not the functions' time.
    """

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self._lock = threading.Lock()
        self._batches: dict[int, dict[str, Any]] = {}
        self._numbered: dict[tuple[Any, bool], int] = {}  # batches seen per (step, validate)
        self._ops = {n: otel_rl.op(_score, name=f"reward {n}", kind=sc.KIND_REWARD) for n in self.names}
        self._completion_op = otel_rl.generate(_completion, name="completion")

    def wrap(self, fn: Callable, name: str) -> Callable:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def traced_async(*args: Any, **kwargs: Any) -> Any:
                try:
                    out = await fn(*args, **kwargs)
                except BaseException as exc:
                    self._scored(name, kwargs, exc)
                    _end_step_in(exc)
                    raise
                self._scored(name, kwargs, out)
                return out

            return traced_async

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            try:
                out = fn(*args, **kwargs)
            except BaseException as exc:
                self._scored(name, kwargs, exc)
                _end_step_in(exc)
                raise
            self._scored(name, kwargs, out)
            return out

        return traced

    def _scored(self, name: str, kwargs: dict, outcome: Any) -> None:
        try:
            h = otel_rl.current()
            if h is None or not h.tracing:
                return
            completions = kwargs.get("completions")
            if completions is None:
                return
            key = id(completions)
            step = _open_step[0]
            with self._lock:
                batch = self._batches.get(key)
                if batch is None or batch["completions"] is not completions:
                    batch = self._batches[key] = {
                        "completions": completions,
                        "scores": {},
                        "kwargs": kwargs,
                        "step": step,
                    }
                batch["scores"][name] = outcome
                done = isinstance(outcome, BaseException) or len(batch["scores"]) == len(self.names)
                if done:
                    del self._batches[key]
            if done:
                self._emit(batch)
        except Exception as exc:  # never let telemetry break the reward computation
            _log.debug("otel-rl: reward tracing failed: %s", exc, exc_info=True)

    def _emit(self, batch: dict) -> None:
        kwargs, scores = batch["kwargs"], batch["scores"]
        completions = batch["completions"]
        prompts = kwargs.get("prompts") or [None] * len(completions)
        ids = kwargs.get("completion_ids") or [None] * len(completions)
        step, validate = batch["step"], False
        if step is None:
            state = kwargs.get("trainer_state")
            step, validate = (int(getattr(state, "global_step", 0)) if state is not None else None), True
        with self._lock:
            nth = self._numbered.get((step, validate), 0)
            if (step, validate) not in self._numbered and len(self._numbered) >= _BATCHES_KEPT:
                del self._numbered[next(iter(self._numbered))]
            self._numbered[(step, validate)] = nth + 1
        groups = _groups(prompts, validate, nth)
        failed = any(isinstance(v, BaseException) for v in scores.values())
        chosen = otel_rl.select_samples(step, sorted({g for g, _ in groups}), validate)
        for i, completion in enumerate(completions):
            g, r = groups[i]
            if g not in chosen and not failed:
                continue  # not sampled: skip the whole trajectory (its ops would record nothing)
            self._one(step, validate, g, r, prompts[i], completion, ids[i], scores, i)

    def _one(
        self, step: Any, validate: bool, g: int, r: int, prompt: Any, completion: Any, ids: Any, scores: dict, i: int
    ) -> None:
        total, any_score, failure = 0.0, False, None
        try:
            with otel_rl.trajectory(
                step=step, sample_index=g, rollout_n=r, validate=validate, name="grpo.completion"
            ) as t:
                self._completion_op(prompt, completion, ids)
                for name in self.names:
                    if name not in scores:
                        continue
                    outcome = scores[name]
                    value = outcome if isinstance(outcome, BaseException) else _item(outcome, i)
                    if isinstance(value, BaseException):
                        failure = (value, value.__traceback__)
                    _replaying.value = value
                    try:
                        self._ops[name](prompt, completion)
                    except BaseException:
                        continue
                    finally:
                        _replaying.value = None
                    if value is not None and not isinstance(value, BaseException):
                        try:
                            total += float(value)
                            any_score = True
                        except (TypeError, ValueError):
                            pass
                if any_score:
                    t.set_reward(total)
                if failure is not None:
                    raise failure[0]  # the trajectory ends in its reward function's error
        except BaseException:
            if failure is None:
                raise
        finally:
            if failure is not None:
                failure[0].__traceback__ = failure[1]  # replayed: TRL sees the original traceback


def _completion(prompt: Any, completion: Any, response_ids: Any = None) -> dict:
    return {"completion": completion, "response_ids": response_ids}


def _item(outcome: Any, i: int) -> Any:
    try:
        v = outcome[i]
    except Exception:
        return None
    return v.item() if hasattr(v, "item") else v


def _groups(prompts: Sequence[Any], validate: bool = False, nth: int = 0) -> list[tuple[int, int]]:
    """(sample index, rollout number) of each completion of this process's part of the `nth` generation
    batch of a step (evaluation scores several batches at one step).

    With the trainer's arguments (`_layout`), as GRPO lays a batch out: the completions of all processes
    one after the other (this process's part at ``process index * len(prompts)``), ``num_generations`` of
    one prompt in a row, and the batches of a step one after the other; so the numbers are unique in the
    step over all processes.  Without them, consecutive equal prompts form one sample, counted from 0 in
    each batch of this process.
    """
    layout = _layout[0]
    size = None if layout is None else (layout[3] if validate else layout[2])
    if layout is not None and size:
        first = (nth * layout[1] + layout[0]) * len(prompts)
        return [divmod(first + i, size) for i in range(len(prompts))]
    out: list[tuple[int, int]] = []
    g = -1
    r = 0
    prev: Any = object()
    for p in prompts:
        if g < 0 or p != prev:
            g, r = g + 1, 0
        else:
            r += 1
        out.append((g, r))
        prev = p
    return out


def trace_rewards(reward_funcs: T) -> T:
    """GRPO reward functions (one or a list) wrapped so that each completion becomes a trajectory trace.

    Functions keep their ``__name__`` (TRL names its ``rewards/<name>/mean`` metrics after it) and
    whether they are ``async``; models and model ids (strings) are returned as they are (TRL scores them
    itself, out of reach).  The wrappers record nothing unless otel-rl is tracing.
    """
    given: Any = reward_funcs
    single = not isinstance(given, (list, tuple))
    funcs = [given] if single else list(given)
    callables = [(i, f) for i, f in enumerate(funcs) if callable(f) and not _is_module(f)]
    names = [getattr(f, "__name__", None) or type(f).__name__ for _, f in callables]
    tracer = RewardTracer(names)
    out = list(funcs)
    for (i, f), name in zip(callables, names):
        out[i] = tracer.wrap(f, name)
    return cast(T, out[0] if single else out)


def _is_module(f: Any) -> bool:
    try:
        import torch

        return isinstance(f, torch.nn.Module)
    except Exception:
        return False
