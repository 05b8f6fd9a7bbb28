"""verl/Hydra dotlist overrides on a nested config: ``a.b=1``, ``+a.c=x`` (add), ``++a.c=x`` (add or
override), ``~a.b`` (delete), with values parsed as Hydra parses them (`parse_value`)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any


class ConfigError(ValueError):
    """A setting that cannot be understood; the message says which and why."""


def parse_value(text: str) -> Any:
    """Parse one dotlist value the way verl/Hydra users write it.

    JSON first (``'["console","mlflow"]'``, ``4``, ``true``), then Hydra's bare
    forms: ``[console,mlflow]``, ``True``/``False``, ``null``/``None``, numbers,
    quoted or bare strings.
    """
    s = text.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        inner = s[1:-1]
        # a quoted list or dict (the shell kept the quotes) is still a list
        if inner.strip().startswith(("[", "{")):
            return parse_value(inner)
        return inner
    try:
        return json.loads(s)
    except ValueError:
        pass
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    if s.startswith("[") and s.endswith("]"):
        body = s[1:-1].strip()
        return [parse_value(p) for p in _split_top(body)] if body else []
    if s.startswith("{") and s.endswith("}"):
        body = s[1:-1].strip()
        out: dict[str, Any] = {}
        for part in _split_top(body) if body else []:
            k, sep, v = part.partition(":")
            if not sep:
                raise ConfigError(f"cannot parse mapping entry {part!r} in {text!r}")
            out[str(parse_value(k))] = parse_value(v)
        return out
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def _split_top(body: str) -> list[str]:
    """Split on commas that are not inside brackets or quotes."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in body:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


# Sections whose keys otel-rl knows, for checking dotlist overrides (`apply_dotlist`): the keys it reads
# and the other keys verl's own configs have there (verl 0.9.1's PPO and SFT trainers, plus older verl's
# ``trainer.wandb_proxy``).
OWNED_SECTIONS: dict[str, frozenset[str]] = {
    "trainer": frozenset(
        {
            "project_name",
            "experiment_name",
            "logger",
            "log_val_generations",
            "balance_batch",
            "checkpoint_callback_class",
            "critic_warmup",
            "default_hdfs_dir",
            "default_local_dir",
            "del_local_ckpt_after_load",
            "device",
            "esi_redundant_time",
            "max_actor_ckpt_to_keep",
            "max_critic_ckpt_to_keep",
            "n_gpus_per_node",
            "nnodes",
            "ray_wait_register_center_timeout",
            "resume_from_path",
            "resume_mode",
            "rollout_data_dir",
            "save_freq",
            "test_freq",
            "total_epochs",
            "total_training_steps",
            "use_v1",
            "v1",
            "val_before_train",
            "val_only",
            "validation_data_dir",
            "wandb_proxy",
            "profile_steps",
            "controller_nsight_options",
            "worker_nsight_options",
            "use_legacy_worker_impl",
            # verl's SFT trainer (sft_trainer_engine.yaml)
            "seed",
            "max_ckpt_to_keep",
            "profile_interval",
        }
    ),
    "actor_rollout_ref.rollout.trace": frozenset(
        {
            "backend",
            "token2text",
            "max_samples_per_step_per_worker",
            "max_samples",
            "project_name",
            "experiment_name",
            "_target_",
        }
    ),
}


def _check_key(cfg: Mapping[str, Any], key: str, item: str, strict: str) -> None:
    """Raise for an override of a key nobody knows (Hydra's rule): `strict` "owned" checks the sections
    otel-rl owns (`OWNED_SECTIONS`, ``otel_rl.``); "all" checks every key against the config given."""
    import difflib

    if get_path(cfg, key)[0]:
        return
    section, _, leaf = key.rpartition(".")
    if section == "otel_rl":
        from .config import Config  # the fields an ``otel_rl:`` section may set

        known: Sequence[str] | None = sorted(f.name for f in dataclasses.fields(Config) if f.name != "verl_config")
    elif section in OWNED_SECTIONS:
        known = sorted(OWNED_SECTIONS[section])
    elif strict == "all" or key.partition(".")[0] == "otel_rl":
        found, node = get_path(cfg, section) if section else (True, cfg)
        known = sorted(node) if found and isinstance(node, Mapping) else None
        if known is None and section:
            known = []
    else:
        return
    if known is not None and leaf in known:
        return
    close = difflib.get_close_matches(leaf, known or [], n=1, cutoff=0.6)
    hint = f" Did you mean {(section + '.' if section else '') + close[0]!r}?" if close else ""
    if section == "otel_rl":
        hint = hint or f" Known: {', '.join(known or [])}."
        raise ConfigError(f"unknown setting {key!r} in override {item!r}.{hint}")
    raise ConfigError(
        f"unknown config key {key!r} in override {item!r}.{hint} To add a new key on purpose, write +{item}"
    )


def apply_dotlist(
    base: Mapping[str, Any] | None, overrides: Sequence[str], strict: str | None = None
) -> dict[str, Any]:
    """Apply verl/Hydra-style overrides (``a.b=v``, ``+a.b=v``, ``++a.b=v``, ``~a.b``).

    `strict` ``"owned"``: an override without ``+`` of a key that is not in `base` and is unknown in a
    section otel-rl owns (`OWNED_SECTIONS`, ``otel_rl.``) raises `ConfigError` naming the closest known key;
    ``"all"``: every key must be in `base` (or be an ``otel_rl.`` setting).  ``+key=value`` adds a key on purpose.
    """
    cfg = to_plain(base) if base is not None else {}
    for item in overrides:
        if not isinstance(item, str):
            raise ConfigError(f"dotlist override must be a string, got {item!r}")
        item = item.strip()
        if not item:
            continue
        if item.startswith("~"):
            _delete(cfg, item[1:].partition("=")[0].strip())
            continue
        key, sep, value = item.lstrip("+").partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"cannot parse override {item!r}: expected key=value")
        if not re.fullmatch(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*", key):
            raise ConfigError(f"cannot parse override {item!r}: bad key {key!r}")
        if strict and not item.startswith("+"):
            _check_key(cfg, key, item, strict)
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = {}
                node[p] = nxt
            node = nxt
        node[parts[-1]] = parse_value(value)
    return cfg


def _delete(cfg: dict, key: str) -> None:
    parts = key.split(".")
    node = cfg
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            return
        node = child
    node.pop(parts[-1], None)


def to_plain(cfg: Any) -> Any:
    """dict / DictConfig / dataclass -> plain nested dicts and lists."""
    mod = type(cfg).__module__
    if mod.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return to_plain(dataclasses.asdict(cfg))
    if isinstance(cfg, Mapping):
        return {str(k): to_plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_plain(v) for v in cfg]
    return cfg


def get_path(cfg: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = cfg
    for p in path.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return False, None
        node = node[p]
    return True, node
