"""otel_rl.config: precedence, verl-shaped configs, dotlists, env, secrets, init errors, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import otel_rl
from otel_rl.config import Config, ConfigError, apply_dotlist, parse_value, resolve
from otel_rl.redact import REDACTED, scrub_secrets

VENV_BIN = Path(sys.executable).parent
OTEL_RL_CLI = str(VENV_BIN / "otel-rl")
NO_ENV: dict[str, str] = {}
TRACE = "actor_rollout_ref.rollout.trace"


def clean_env() -> dict[str, str]:
    """os.environ without any OTEL_* / rank variables that could leak into a subprocess."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("OTEL_") and k not in ("RANK", "LOCAL_RANK")}


# ----------------------------------------------------------------------------- defaults


def test_defaults_with_empty_env():
    cfg = resolve(env=NO_ENV)
    d = Config()
    assert (cfg.project, cfg.experiment, cfg.exporters, cfg.max_samples, cfg.token2text, cfg.trace_backend,
            cfg.rank, cfg.service_name, cfg.disabled) == (
        d.project, d.experiment, d.exporters, d.max_samples, d.token2text, d.trace_backend,
        d.rank, d.service_name, d.disabled)
    assert cfg.run_id and len(cfg.run_id) == 16  # a fresh id when none is given
    assert resolve(env=NO_ENV).run_id != cfg.run_id


# ----------------------------------------------------------------------------- precedence

# field -> (env vars, config dotlist, keyword arguments, expected value per layer: env, config, arg)
PRECEDENCE = {
    "project": ({"OTEL_RL_PROJECT": "p-env"}, ["trainer.project_name=p-cfg"], {"project": "p-arg"},
                ("p-env", "p-cfg", "p-arg")),
    "experiment": ({"OTEL_RL_EXPERIMENT": "e-env"}, ["trainer.experiment_name=e-cfg"], {"experiment": "e-arg"},
                   ("e-env", "e-cfg", "e-arg")),
    "exporters": ({"OTEL_RL_EXPORTERS": "file,otlp"}, ['trainer.logger=["console","mlflow"]'],
                  {"logger": ["prometheus"]},
                  (("file", "otlp"), ("console", "mlflow"), ("prometheus",))),
    "max_samples": ({"OTEL_RL_MAX_SAMPLES": "1"}, [f"{TRACE}.max_samples_per_step_per_worker=4"],
                    {"max_samples": 7}, (1, 4, 7)),
    "token2text": ({"OTEL_RL_TOKEN2TEXT": "true"}, [f"{TRACE}.token2text=false"], {"token2text": True},
                   (True, False, True)),
    "trace_backend": ({"OTEL_RL_TRACE_BACKEND": "mlflow"}, [f"{TRACE}.backend=weave"],
                      {"trace_backend": "file"}, ("mlflow", "weave", "file")),
    "rank": ({"OTEL_RL_RANK": "3"}, ["otel_rl.rank=5"], {"rank": 9}, (3, 5, 9)),
    "service_name": ({"OTEL_SERVICE_NAME": "svc-env"}, ["otel_rl.service_name=svc-cfg"],
                     {"service_name": "svc-arg"}, ("svc-env", "svc-cfg", "svc-arg")),
    "log_val_generations": ({"OTEL_RL_LOG_VAL_GENERATIONS": "2"}, ["trainer.log_val_generations=10"],
                            {"log_val_generations": 20}, (2, 10, 20)),
}


@pytest.mark.parametrize("field", sorted(PRECEDENCE))
def test_precedence_each_layer(field):
    env, dotlist, kwargs, (v_env, v_cfg, v_arg) = PRECEDENCE[field]
    default = getattr(Config(), field)
    assert getattr(resolve(env=NO_ENV), field) == default
    assert getattr(resolve(env=env), field) == v_env
    assert getattr(resolve(dotlist, env=env), field) == v_cfg
    assert getattr(resolve(dotlist, env=NO_ENV), field) == v_cfg
    assert getattr(resolve(dotlist, env=env, **kwargs), field) == v_arg
    assert getattr(resolve(env=env, **kwargs), field) == v_arg
    assert getattr(resolve(env=NO_ENV, **kwargs), field) == v_arg
    # sanity: the layers really differ, so the test can tell them apart
    assert default != v_env and v_env != v_cfg and v_cfg != v_arg


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(PRECEDENCE)), st.booleans(), st.booleans(), st.booleans())
def test_precedence_property(field, use_env, use_cfg, use_arg):
    env, dotlist, kwargs, (v_env, v_cfg, v_arg) = PRECEDENCE[field]
    cfg = resolve(dotlist if use_cfg else None, env=env if use_env else NO_ENV, **(kwargs if use_arg else {}))
    expected = (v_arg if use_arg else v_cfg if use_cfg else v_env if use_env else getattr(Config(), field))
    assert getattr(cfg, field) == expected


def test_keyword_none_means_not_given():
    cfg = resolve([f"{TRACE}.max_samples=4", "trainer.project_name=p"], env=NO_ENV, max_samples=None, project=None)
    assert cfg.max_samples == 4 and cfg.project == "p"


def test_keyword_aliases_logger_and_max_samples_per_step_per_worker():
    cfg = resolve(env=NO_ENV, logger="file", max_samples_per_step_per_worker=3)
    assert cfg.exporters == ("file",) and cfg.max_samples == 3


def test_unknown_keyword_is_config_error():
    with pytest.raises(ConfigError, match="bogus_setting"):
        resolve(env=NO_ENV, bogus_setting=1)


def test_trace_backend_is_added_to_exporter_names():
    cfg = resolve(["trainer.logger=[console,file]", f"{TRACE}.backend=mlflow"], env=NO_ENV)
    assert cfg.exporter_names() == ["console", "file", "mlflow"]
    cfg = resolve(["trainer.logger=[console,file]", f"{TRACE}.backend=file"], env=NO_ENV)
    assert cfg.exporter_names() == ["console", "file"]


# ----------------------------------------------------------------------------- verl-shaped config

VERL_DICT = {
    "trainer": {"project_name": "gsm8k", "experiment_name": "grpo-0", "logger": ["console", "mlflow"],
                "log_val_generations": 10},
    "actor_rollout_ref": {"rollout": {"trace": {"backend": "mlflow", "token2text": True,
                                                "max_samples_per_step_per_worker": 4}}},
}


def _check_verl(cfg: Config) -> None:
    assert cfg.project == "gsm8k"
    assert cfg.experiment == "grpo-0"
    assert cfg.exporters == ("console", "mlflow")
    assert cfg.log_val_generations == 10
    assert cfg.trace_backend == "mlflow"
    assert cfg.token2text is True
    assert cfg.max_samples == 4


def test_verl_config_as_dict():
    cfg = resolve(VERL_DICT, env=NO_ENV)
    _check_verl(cfg)
    assert cfg.verl_config == VERL_DICT


def test_verl_config_as_omegaconf():
    dc = OmegaConf.create(VERL_DICT)
    cfg = resolve(dc, env=NO_ENV)
    _check_verl(cfg)
    assert cfg.verl_config == VERL_DICT
    assert type(cfg.verl_config["trainer"]["logger"]) is list  # plain containers, not ListConfig


def test_verl_config_omegaconf_interpolation_resolved():
    dc = OmegaConf.create({"name": "exp-7", "trainer": {"experiment_name": "${name}"}})
    assert resolve(dc, env=NO_ENV).experiment == "exp-7"


def test_verl_config_as_dotlist():
    dotlist = [
        "trainer.project_name=gsm8k",
        "trainer.experiment_name=grpo-0",
        'trainer.logger=["console","mlflow"]',
        "trainer.log_val_generations=10",
        f"{TRACE}.backend=mlflow",
        f"{TRACE}.token2text=True",
        f"{TRACE}.max_samples_per_step_per_worker=4",
    ]
    cfg = resolve(dotlist, env=NO_ENV)
    _check_verl(cfg)
    assert cfg.verl_config == VERL_DICT


def test_config_plus_overrides_argument():
    cfg = resolve(VERL_DICT, overrides=["trainer.experiment_name=grpo-1", "trainer.logger=console"], env=NO_ENV)
    assert cfg.experiment == "grpo-1" and cfg.exporters == ("console",)
    assert VERL_DICT["trainer"]["experiment_name"] == "grpo-0"  # input not mutated


@pytest.mark.parametrize("override, expected", [
    ('trainer.logger=["console","mlflow"]', ("console", "mlflow")),  # shell stripped the single quotes
    ("""trainer.logger='["console","mlflow"]'""", ("console", "mlflow")),  # quotes kept
    ('''trainer.logger="['console','mlflow']"''', ("console", "mlflow")),
    ("trainer.logger=[console,file]", ("console", "file")),
    ("trainer.logger=[ console , file ]", ("console", "file")),
    ("trainer.logger=console", ("console",)),
    ("trainer.logger='console'", ("console",)),
    ("trainer.logger=console,file", ("console", "file")),
    ("trainer.logger=[]", ()),
])
def test_logger_forms(override, expected):
    assert resolve([override], env=NO_ENV).exporters == expected


def test_dotlist_plus_plusplus_and_tilde():
    base = {"trainer": {"project_name": "a", "logger": ["file"]}}
    out = apply_dotlist(base, ["+trainer.experiment_name=new", "++trainer.project_name=b", "~trainer.logger"])
    assert out == {"trainer": {"project_name": "b", "experiment_name": "new"}}
    assert base == {"trainer": {"project_name": "a", "logger": ["file"]}}  # not mutated
    # ~key=value form and deleting a missing key are harmless
    assert apply_dotlist({"a": {"b": 1, "c": 2}}, ["~a.b=1", "~x.y.z", "~a.zz"]) == {"a": {"c": 2}}
    # resolve sees the result: the removed logger falls back to env, then default
    cfg = resolve(["trainer.logger=[file]", "~trainer.logger"], env={"OTEL_RL_EXPORTERS": "otlp"})
    assert cfg.exporters == ("otlp",)
    cfg = resolve(["+trainer.project_name=p1", "++trainer.experiment_name=e1"], env=NO_ENV)
    assert (cfg.project, cfg.experiment) == ("p1", "e1")


def test_dotlist_value_with_equals_and_scalar_replaced_by_section():
    out = apply_dotlist({"a": 5}, ["a.b=x=y"])
    assert out == {"a": {"b": "x=y"}}


def test_max_samples_alias_and_precedence_between_them():
    assert resolve([f"{TRACE}.max_samples=3"], env=NO_ENV).max_samples == 3
    both = [f"{TRACE}.max_samples=3", f"{TRACE}.max_samples_per_step_per_worker=4"]
    assert resolve(both, env=NO_ENV).max_samples == 4  # the verl key wins over the short alias
    assert resolve(list(reversed(both)), env=NO_ENV).max_samples == 4
    assert resolve([f"{TRACE}.max_samples_per_step_per_worker=null", f"{TRACE}.max_samples=2"],
                   env=NO_ENV).max_samples == 2
    assert resolve([f"{TRACE}.max_samples_per_step_per_worker=0"], env=NO_ENV).max_samples == 0


def test_log_val_generations():
    assert resolve(["trainer.log_val_generations=10"], env=NO_ENV).log_val_generations == 10
    assert resolve({"trainer": {"log_val_generations": 0}}, env=NO_ENV).log_val_generations == 0


def test_otel_rl_section_sets_fields_by_name():
    cfg = resolve(["otel_rl.rank=2", "otel_rl.batch_delay_s=0.5", "otel_rl.tracing=false",
                   "otel_rl.jsonl_path=/tmp/x.jsonl", "otel_rl.prometheus_port=9999",
                   "otel_rl.resource_attributes={team: rl, gpu: 8}", "otel_rl.exporters=[file]",
                   "otel_rl.max_samples=null", "otel_rl.run_id=abc"], env=NO_ENV)
    assert cfg.rank == 2 and cfg.batch_delay_s == 0.5 and cfg.tracing is False
    assert cfg.jsonl_path == "/tmp/x.jsonl" and cfg.prometheus_port == 9999
    assert cfg.resource_attributes == {"team": "rl", "gpu": 8}
    assert cfg.exporters == ("file",) and cfg.max_samples is None and cfg.run_id == "abc"
    # the otel_rl section wins over the verl keys of the same field
    cfg = resolve(["trainer.project_name=verl", "otel_rl.project=ours"], env=NO_ENV)
    assert cfg.project == "ours"


def test_otel_rl_section_in_omegaconf():
    dc = OmegaConf.create({"otel_rl": {"max_samples": 6, "token2text": "yes"}})
    cfg = resolve(dc, env=NO_ENV)
    assert cfg.max_samples == 6 and cfg.token2text is True


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("overrides, words", [
    (["otel_rl.bogus=1"], ["otel_rl.bogus", "project"]),  # unknown field, lists known ones
    (["otel_rl.verl_config={a: 1}"], ["otel_rl.verl_config"]),
    (["trainer.project_name"], ["trainer.project_name", "key=value"]),  # no '='
    (["=5"], ["=5"]),
    (["a..b=1"], ["a..b"]),
    (["a b=1"], ["a b"]),
    (["x={a}"], ["{a}"]),
    (["trainer.log_val_generations=abc"], ["log_val_generations", "integer", "abc"]),
    (["trainer.log_val_generations=-1"], ["log_val_generations", ">= 0"]),
    (["trainer.log_val_generations=1.5"], ["log_val_generations", "integer"]),
    (["otel_rl.rank=true"], ["rank", "integer"]),
    ([f"{TRACE}.max_samples_per_step_per_worker=many"], ["max_samples", "max_samples_per_step_per_worker"]),
    ([f"{TRACE}.max_samples=-2"], ["max_samples", ">= 0"]),
    ([f"{TRACE}.token2text=maybe"], ["token2text", "boolean", "maybe"]),
    (["otel_rl.tracing=sometimes"], ["tracing", "boolean"]),
    (["otel_rl.batch_delay_s=soon"], ["batch_delay_s", "soon"]),
    (["trainer.logger=[console,1]"], ["exporters", "1"]),
    (["trainer.logger={a: b}"], ["exporters"]),
    ([f"{TRACE}.backend=[a,b]"], ["trace_backend"]),
    (["trainer.project_name=[a,b]"], ["project", "scalar"]),
    (["otel_rl.resource_attributes=x"], ["resource_attributes", "mapping"]),
])
def test_config_errors_name_the_field(overrides, words):
    with pytest.raises(ConfigError) as info:
        resolve(overrides, env=NO_ENV)
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)


def test_non_string_override_and_non_mapping_config():
    with pytest.raises(ConfigError, match="string"):
        apply_dotlist({}, [5])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="mapping"):
        resolve(42, env=NO_ENV)


@pytest.mark.parametrize("env, words", [
    ({"OTEL_RL_MAX_SAMPLES": "x"}, ["max_samples", "OTEL_RL_MAX_SAMPLES"]),
    ({"OTEL_RL_RANK": "1.5"}, ["rank", "OTEL_RL_RANK"]),
    ({"RANK": "zero"}, ["rank", "RANK"]),
    ({"OTEL_RL_TOKEN2TEXT": "perhaps"}, ["token2text", "OTEL_RL_TOKEN2TEXT"]),
    ({"OTEL_EXPORTER_PROMETHEUS_PORT": "http"}, ["prometheus_port", "OTEL_EXPORTER_PROMETHEUS_PORT"]),
])
def test_env_errors_name_the_variable(env, words):
    with pytest.raises(ConfigError) as info:
        resolve(env=env)
    for w in words:
        assert w in str(info.value)


def test_bad_keyword_argument_value():
    with pytest.raises(ConfigError, match="rank"):
        resolve(env=NO_ENV, rank="two")
    with pytest.raises(ConfigError, match="max_samples"):
        resolve(env=NO_ENV, max_samples=-1)


# ----------------------------------------------------------------------------- parse_value / apply_dotlist


@pytest.mark.parametrize("text, expected", [
    ("4", 4), ("-3", -3), ("2.5", 2.5), ("1e3", 1000.0), ("true", True), ("True", True), ("FALSE", False),
    ("null", None), ("None", None), ("~", None), ("abc", "abc"), ("'4'", "4"), ('"true"', "true"),
    ("[a, 'b c', 3]", ["a", "b c", 3]), ("[[1,2],[x]]", [[1, 2], ["x"]]), ("[]", []),
    ("{a: 1, b: [x, y]}", {"a": 1, "b": ["x", "y"]}), ("{}", {}), ('{"k": "v"}', {"k": "v"}),
    ("  spaced  ", "spaced"), ("", ""),
])
def test_parse_value_forms(text, expected):
    assert parse_value(text) == expected
    assert type(parse_value(text)) is type(expected)


JSONISH = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.lists(st.text(max_size=8), max_size=5),
)


@settings(max_examples=300, deadline=None)
@given(JSONISH)
def test_parse_value_round_trips_json(value):
    parsed = parse_value(json.dumps(value))
    assert parsed == value
    assert type(parsed) is type(value)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True), min_size=1, max_size=5))
def test_parse_value_bare_hydra_list(names):
    # Hydra's unquoted list form, as after shell quote stripping
    text = "[" + ",".join(names) + "]"
    parsed = parse_value(text)
    expected = [parse_value(n) for n in names]  # bare words keep Hydra's scalar rules (True, null, ...)
    assert repr(parsed) == repr(expected)  # repr: a bare "nan" parses to NaN on both sides
    assert len(parsed) == len(names)


KEY_PART = st.from_regex(r"[A-Za-z0-9_\-]{1,8}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(KEY_PART, min_size=1, max_size=5), value=st.integers(), prefix=st.sampled_from(["", "+", "++"]))
def test_apply_dotlist_sets_exactly_that_path(parts, value, prefix):
    key = ".".join(parts)
    out = apply_dotlist({}, [f"{prefix}{key}={value}"])
    expected: object = value
    for p in reversed(parts):
        expected = {p: expected}
    assert out == expected
    # on top of an unrelated base, only that path changes
    base = {"zz_unrelated": {"keep": [1, 2]}, "zz_other": "x"}
    out2 = apply_dotlist(base, [f"{key}={value}"])
    assert out2 == {**base, **expected}
    # and deleting it again leaves empty sections behind but no value
    out3 = apply_dotlist(out2, [f"~{key}"])
    node = out3
    for p in parts[:-1]:
        node = node[p]
    assert parts[-1] not in node


# ----------------------------------------------------------------------------- secrets


def test_scrub_secrets_any_depth():
    cfg = {
        "trainer": {"project_name": "p", "wandb_api_key": "k1"},
        "api_key": "k0",
        "deep": [{"x": {"y": {"hf_token": "t", "db_password": "pw", "value": 3}}}],
        "apiKey": "k2", "accessToken": "t2", "client_secret": "s", "aws_secret_access_key": "s2",
        "OPENAI_API_KEY": "k3", "x-api-key": "k4", "passwd": "p", "credentials": "c",
        "otel_rl": {"otlp_headers": "Authorization=Bearer xyz"},
        "auth": {"token": "nested", "user": "me"},
    }
    out = scrub_secrets(cfg)
    for path in [("trainer", "wandb_api_key"), ("api_key",), ("apiKey",), ("accessToken",), ("client_secret",),
                 ("aws_secret_access_key",), ("OPENAI_API_KEY",), ("x-api-key",), ("passwd",), ("credentials",),
                 ("otel_rl", "otlp_headers"), ("auth", "token")]:
        node = out
        for p in path:
            node = node[p]
        assert node == REDACTED, path
    leaf = out["deep"][0]["x"]["y"]
    assert leaf == {"hf_token": REDACTED, "db_password": REDACTED, "value": 3}
    assert out["trainer"]["project_name"] == "p"
    assert out["auth"]["user"] == "me"  # a secret-named section is walked, not blanked
    assert cfg["api_key"] == "k0"  # the input is not modified


def test_scrub_secrets_leaves_ordinary_keys():
    # verl hyper-parameters that merely contain "token" or "auth" must stay visible
    cfg = {"actor": {"ppo_max_token_len_per_gpu": 16384, "max_num_batched_tokens": 8192},
           "trace": {"token2text": True}, "model": {"tokenizer_path": "/m", "author": "me"},
           "otlp_headers": None, "keys": ["a"], "monkey": 1}
    assert scrub_secrets(cfg) == cfg


def test_run_config_secrets_scrubbed_in_cli(tmp_path):
    env = clean_env()
    res = subprocess.run([OTEL_RL_CLI, "config", "trainer.project_name=p", "+trainer.wandb_api_key=SECRET1",
                          "otel_rl.otlp_headers=Authorization=Bearer SECRET2"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "SECRET1" not in res.stdout and "SECRET2" not in res.stdout
    out = json.loads(res.stdout)
    assert out["verl_config"]["trainer"]["wandb_api_key"] == REDACTED
    assert out["otlp_headers"] == REDACTED


# ----------------------------------------------------------------------------- env


def test_env_sdk_disabled():
    assert resolve(env={"OTEL_SDK_DISABLED": "true"}).disabled is True
    assert resolve(env={"OTEL_SDK_DISABLED": "TRUE"}).disabled is True
    assert resolve(env={"OTEL_SDK_DISABLED": "false"}).disabled is False
    assert resolve(env=NO_ENV).disabled is False


def test_env_rank_fallbacks():
    assert resolve(env={"RANK": "3"}).rank == 3
    assert resolve(env={"LOCAL_RANK": "2"}).rank == 2
    assert resolve(env={"RANK": "3", "LOCAL_RANK": "2"}).rank == 3
    assert resolve(env={"RANK": "3", "OTEL_RL_RANK": "7"}).rank == 7
    assert resolve(env={"RANK": ""}).rank == 0


def test_env_service_name_run_id_and_misc():
    cfg = resolve(env={"OTEL_SERVICE_NAME": "trainer-svc", "OTEL_RL_RUN_ID": "run-42", "OTEL_RL_TRACING": "1",
                       "OTEL_RL_JSONL_PATH": "/tmp/a.jsonl", "OTEL_EXPORTER_PROMETHEUS_PORT": "9100",
                       "OTEL_RL_BATCH_DELAY_S": "0.01", "OTEL_RL_MAX_SAMPLES": ""})
    assert cfg.service_name == "trainer-svc" and cfg.run_id == "run-42" and cfg.tracing is True
    assert cfg.jsonl_path == "/tmp/a.jsonl" and cfg.prometheus_port == 9100 and cfg.batch_delay_s == 0.01
    assert cfg.max_samples is None  # an empty variable is "not set"


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("OTEL_RL_PROJECT", "from-os-environ")
    assert resolve().project == "from-os-environ"
    assert resolve(env=NO_ENV).project == Config().project


def test_worker_env_round_trips_through_resolve(tmp_path):
    from otel_rl.testing import CaptureExporter

    h = otel_rl.init(exporters=[CaptureExporter()], project="p", experiment="e", run_id="rid",
                     max_samples=3, token2text=True, trace_backend="file", batch_delay_s=0.05,
                     jsonl_path=str(tmp_path / "w.jsonl"))
    try:
        wenv = h.worker_env()
    finally:
        h.shutdown()
    cfg = resolve(env={**wenv, "RANK": "4"})
    assert (cfg.project, cfg.experiment, cfg.run_id, cfg.max_samples, cfg.token2text, cfg.trace_backend,
            cfg.rank) == ("p", "e", "rid", 3, True, "file", 4)


# ----------------------------------------------------------------------------- init errors


def test_init_unknown_exporter_lists_installed_names():
    with pytest.raises(otel_rl.UnknownExporterError) as info:
        otel_rl.init(exporters=["no_such_exporter"])
    msg = str(info.value)
    assert "no_such_exporter" in msg
    for name in ("console", "file", "otlp", "prometheus"):
        assert name in msg


def test_init_unknown_exporter_via_config_and_trace_backend():
    with pytest.raises(otel_rl.UnknownExporterError, match="nope"):
        otel_rl.init(["trainer.logger=[console,nope]"])
    with pytest.raises(otel_rl.UnknownExporterError, match="vemlp_wandb"):
        otel_rl.init(logger="vemlp_wandb")


@pytest.mark.parametrize("name", ["mlflow", "wandb", "swanlab", "weave"])
def test_init_tracker_without_exporter_distribution_says_how_to_install(monkeypatch, name):
    from otel_rl.exporters import registry

    # as on a machine without the otel-rl-<tracker> distribution (it may be installed here)
    real = registry._entry_points
    monkeypatch.setattr(registry, "_entry_points", lambda: {k: v for k, v in real().items() if k != name})
    with pytest.raises(otel_rl.UnknownExporterError) as info:
        otel_rl.init(logger=["console", name])
    assert f"pip install 'otel-rl[{name}]'" in str(info.value)
    assert otel_rl.current() is None


def test_init_bad_config_raises_config_error():
    with pytest.raises(otel_rl.ConfigError, match="otel_rl.nope"):
        otel_rl.init(["otel_rl.nope=1"])


# ----------------------------------------------------------------------------- CLI


def test_cli_config_prints_resolved_json():
    res = subprocess.run([OTEL_RL_CLI, "config", "trainer.project_name=p", "trainer.logger=[console,file]",
                          f"{TRACE}.max_samples=2"],
                         capture_output=True, text=True, env={**clean_env(), "OTEL_RL_EXPERIMENT": "env-exp"},
                         timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["project"] == "p"
    assert out["experiment"] == "env-exp"
    assert out["exporters"] == ["console", "file"]
    assert out["max_samples"] == 2
    assert out["verl_config"]["trainer"]["project_name"] == "p"


def test_cli_config_error_exit_code():
    res = subprocess.run([OTEL_RL_CLI, "config", "otel_rl.bogus=1"], capture_output=True, text=True,
                         env=clean_env(), timeout=60)
    assert res.returncode == 2
    assert "otel_rl.bogus" in res.stderr


def test_cli_exporters_lists_builtins():
    res = subprocess.run([OTEL_RL_CLI, "exporters"], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    names = res.stdout.split()
    for name in ("console", "file", "otlp", "prometheus"):
        assert name in names
    assert names == sorted(names)


@pytest.mark.parametrize("override, suggestion", [
    ("trainer.loger=console", "'trainer.logger'"),
    ("trainer.project_nme=x", "'trainer.project_name'"),
    ("actor_rollout_ref.rollout.trace.backnd=mlflow", "'actor_rollout_ref.rollout.trace.backend'"),
    ("otel_rl.jsonl_pth=x", "'otel_rl.jsonl_path'"),
])
def test_override_typo_in_owned_section_fails_with_the_closest_key(override, suggestion):
    with pytest.raises(ConfigError) as info:
        otel_rl.init([override])
    assert suggestion in str(info.value)
    assert otel_rl.current() is None


def test_plus_adds_a_key_on_purpose_and_verl_config_objects_pass_as_they_are():
    cfg = resolve(["+trainer.loger=console", "trainer.total_epochs=3", "data.anything=1"], env=NO_ENV)
    assert cfg.verl_config["trainer"]["loger"] == "console" and cfg.exporters == ("console",)
    whole = {"trainer": {"project_name": "p", "my_own_key": 1, "loger": "x"}, "data": {"x": 1}}
    assert resolve(whole, env=NO_ENV).project == "p"


def _verl_trainer_configs() -> list[Path]:
    """verl's own composed trainer configs, as installed (PPO with each engine, SFT)."""
    try:
        import verl
    except ImportError:
        return []
    root = Path(verl.__file__).parent / "trainer" / "config"
    return sorted(p for p in [*root.glob("_generated_*.yaml"), root / "sft_trainer_engine.yaml"] if p.is_file())


@pytest.mark.parametrize("path", _verl_trainer_configs(), ids=lambda p: p.name)
def test_every_key_of_verls_own_trainer_configs_is_accepted_as_an_override(path):
    """verl's configs as they are: the whole object is accepted, and so is each key of the sections
    otel-rl checks given alone as an override (a verl command line passed to `init()`), with its value."""
    cfg = OmegaConf.load(path)
    assert resolve(cfg, env=NO_ENV).project == cfg.trainer.project_name
    sections = {"trainer": cfg.trainer, TRACE: OmegaConf.select(cfg, TRACE)}
    items = [f"{name}.{k}={json.dumps(v)}" for name, node in sections.items() if node is not None
             for k, v in OmegaConf.to_container(node, resolve=False).items()]
    assert len(items) >= 15
    for item in items:
        resolve([item], env=NO_ENV)
    with pytest.raises(ConfigError, match="'trainer.project_name'"):
        resolve(cfg, overrides=["trainer.project_nam=x"], env=NO_ENV)

