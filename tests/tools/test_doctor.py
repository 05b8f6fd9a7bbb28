"""`otel-rl doctor` against real broken setups: each failure kind is told with its own cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel_rl.config import resolve
from otel_rl.doctor import run_checks
from otel_rl.records import RunIdentity, StepMetrics
from otel_rl.spool.codec import encode_batch
from otel_rl.spool.store import Spool, SpoolOptions

from .conftest import REPO, VENV_BIN, blackhole, clean_env, dead_port

SECRET = "k" * 24 + "SECRETVALUE" + "9" * 10


def checks(overrides, env, tmp_path, timeout=1.0, min_free=1 << 20):
    env = dict(env)
    env.setdefault("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = resolve(list(overrides), env=env)
    os.environ["XDG_CACHE_HOME"] = env["XDG_CACHE_HOME"]  # the spool's default root
    return run_checks(cfg, env=env, timeout=timeout, min_free=min_free)


def find(result, subject, name=None):
    got = [c for c in result if c.subject.startswith(subject) and (name is None or c.name == name)]
    assert got, f"no {subject}/{name} check in {result}"
    return got[0] if name else got


def doctor_cli(args, env, timeout=60):
    env = dict(env, PYTHONPATH=os.environ.get("PYTHONPATH", str(REPO)))
    t0 = time.monotonic()
    p = subprocess.run(
        [str(VENV_BIN / "otel-rl"), "doctor", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    return p, time.monotonic() - t0


def test_dead_otlp_port_is_refused(tmp_path):
    port = dead_port()
    res = checks(["trainer.logger=[otlp]", f"+otel_rl.otlp_endpoint=http://127.0.0.1:{port}"], clean_env(), tmp_path)
    c = find(res, "otlp", "endpoint")
    assert c.status == "fail" and "refused" in c.detail and str(port) in c.detail
    assert "start the OTLP receiver" in c.fix


def test_blackholed_port_times_out_within_the_timeout(tmp_path):
    with blackhole() as port:
        t0 = time.monotonic()
        res = checks(
            ["trainer.logger=[mlflow]"],
            clean_env(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}"),
            tmp_path,
            timeout=0.5,
        )
        took = time.monotonic() - t0
    c = find(res, "mlflow", "endpoint")
    assert c.status == "fail" and "no answer within 0.5 s" in c.detail
    assert took < 5  # one bounded step, not a hang


def test_read_only_directory_is_named(tmp_path, readonly_dir):
    res = checks(["trainer.logger=[file]", f"+otel_rl.jsonl_path={readonly_dir}/sub/run.jsonl"], clean_env(), tmp_path)
    c = find(res, "file", "JSONL file")
    assert c.status == "fail" and "read-only" in c.detail and str(readonly_dir) in c.detail


def test_full_filesystem_fails_write_and_free_space(tmp_path, full_fs):
    res = checks(["trainer.logger=[mlflow]"], clean_env(MLFLOW_TRACKING_URI=f"sqlite:///{full_fs}/mlruns.db"), tmp_path)
    store, free = find(res, "mlflow", "store"), find(res, "mlflow", "free space")
    assert store.status == "fail" and "disk is full" in store.detail
    assert free.status == "fail" and "free" in free.detail


def test_writable_paths_pass_and_report_free_space(tmp_path):
    res = checks(
        ["trainer.logger=[file,mlflow]", f"+otel_rl.jsonl_path={tmp_path}/a/b.jsonl"],
        clean_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlruns.db"),
        tmp_path,
    )
    for c in find(res, "file") + find(res, "mlflow"):
        assert c.status == "ok", c
    assert "will be created" in find(res, "file", "JSONL file").detail
    # the URI as set (an absolute sqlite path has four slashes)
    assert find(res, "mlflow", "tracking URI").detail == f"MLFLOW_TRACKING_URI=sqlite:///{tmp_path}/mlruns.db"


def test_missing_and_malformed_wandb_key(tmp_path):
    base = {"WANDB_BASE_URL": f"http://127.0.0.1:{dead_port()}", "NETRC": str(tmp_path / "none")}
    res = checks(["trainer.logger=[wandb]"], clean_env(**base), tmp_path)
    c = find(res, "wandb", "credentials")
    assert c.status == "fail" and c.detail == "WANDB_API_KEY is not set"
    res = checks(["trainer.logger=[wandb]"], clean_env(WANDB_API_KEY=f'"{SECRET}"', **base), tmp_path)
    c = find(res, "wandb", "credentials")
    assert c.status == "fail" and "wrapped in quotes" in c.detail
    assert SECRET not in json.dumps([vars(x) for x in res])


def test_offline_wandb_needs_no_key(tmp_path):
    res = checks(["trainer.logger=[wandb]"], clean_env(WANDB_MODE="offline", WANDB_DIR=str(tmp_path)), tmp_path)
    assert find(res, "wandb", "mode").status == "ok"
    assert not [c for c in res if c.subject == "wandb" and c.status == "fail"]


def test_refusing_proxy_is_told_apart_from_the_server(tmp_path, refusing_proxy):
    env = clean_env(WANDB_API_KEY=SECRET, WANDB_BASE_URL="https://wandb.internal.test", NETRC=str(tmp_path / "x"))
    res = checks(
        ["trainer.logger=[wandb]", f"+trainer.wandb_proxy=http://user:pw@127.0.0.1:{refusing_proxy.port}"],
        env,
        tmp_path,
    )
    c = find(res, "wandb", "endpoint")
    assert c.status == "fail" and "refused the tunnel to wandb.internal.test:443" in c.detail
    assert "403" in c.detail and "user:***@" in c.detail and ":pw@" not in c.detail
    assert refusing_proxy.requests == ["CONNECT wandb.internal.test:443 HTTP/1.1"]


def test_dead_proxy_from_https_proxy_variable(tmp_path):
    env = clean_env(
        WANDB_API_KEY=SECRET,
        WANDB_BASE_URL="https://wandb.internal.test",
        NETRC=str(tmp_path / "x"),
        HTTPS_PROXY=f"http://127.0.0.1:{dead_port()}",
    )
    c = find(checks(["trainer.logger=[wandb]"], env, tmp_path), "wandb", "endpoint")
    assert c.status == "fail" and c.detail.count("proxy") >= 2 and "refused" in c.detail


def test_tls_to_a_plain_http_port_is_a_tls_failure(tmp_path):
    import http.server
    import threading

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = clean_env(MLFLOW_TRACKING_URI=f"https://127.0.0.1:{srv.server_address[1]}")
        c = find(checks(["trainer.logger=[mlflow]"], env, tmp_path), "mlflow", "endpoint")
    finally:
        srv.shutdown()
    assert c.status == "fail" and c.detail.split(": ", 1)[1].startswith("TLS")


def _spool_with(tmp_path: Path, n: int) -> Path:
    root = tmp_path / "spool"
    sp = Spool(SpoolOptions(path=str(root / "mlflow"), meta={"exporter": "mlflow", "class": "x:y", "config": {}}))
    assert sp.open()
    for step in range(n):
        payload = encode_batch([], [StepMetrics(RunIdentity("p", "e", "r"), step, {"a": 1.0}, step)], compress=False)
        sp.append(payload, 1)
    sp.close(remove_if_empty=False)
    return root


def test_undelivered_spool_is_counted_with_the_replay_command(tmp_path):
    root = _spool_with(tmp_path, 7)
    res = checks(["trainer.logger=[console]", f"+otel_rl.spool_dir={root}"], clean_env(), tmp_path)
    c = find(res, "spool", "undelivered")
    assert c.status == "warn" and c.detail.startswith("7 items")
    assert c.fix.startswith(f"deliver them with `otel-rl replay {root}`")


def test_log_level_above_warning_is_flagged(tmp_path):
    res = checks(["trainer.logger=[console]"], clean_env(VERL_LOGGING_LEVEL="ERROR"), tmp_path)
    c = find(res, "log level", "VERL_LOGGING_LEVEL")
    assert c.status == "warn" and "hidden" in c.detail
    res = checks(["trainer.logger=[console]"], clean_env(), tmp_path)
    assert find(res, "log level")[0].status == "ok"


def test_unknown_exporter_fails(tmp_path):
    c = find(checks(["trainer.logger=[nosuchtracker]"], clean_env(), tmp_path), "nosuchtracker", "exporter")
    assert c.status == "fail" and "unknown exporter" in c.detail


@pytest.mark.slow
def test_wrong_and_right_token_against_a_real_bridge(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    from bridge.helpers import BridgeProcess
    from bridge.helpers import clean_env as bridge_env

    bridge = BridgeProcess(
        ["--exporters", "console", "--auth-token-env", "BRIDGE_TOKEN", "--grpc-address", "off"],
        bridge_env(BRIDGE_TOKEN=SECRET),
        tmp_path,
    )
    try:
        base = ["trainer.logger=[otlp]", f"+otel_rl.otlp_endpoint=http://{bridge.http}"]
        res = checks(base + ["+otel_rl.otlp_headers=Authorization=Bearer wrong-token"], clean_env(), tmp_path)
        assert find(res, "otlp", "bridge").status == "ok"
        c = find(res, "otlp", "export")
        assert c.status == "fail" and "HTTP 401" in c.detail and "Authorization" in c.detail
        assert "--auth-token-env" in c.fix
        res = checks(base + [f"+otel_rl.otlp_headers=Authorization=Bearer {SECRET}"], clean_env(), tmp_path)
        assert find(res, "otlp", "export").status == "ok"
        res = checks(base, clean_env(), tmp_path)
        assert "no headers sent" in find(res, "otlp", "export").detail
    finally:
        bridge.kill()


def _trace_endpoints(url: str) -> dict[str, int]:
    """What the server answers on the two trace paths an MLflow 3 client (the one installed) writes to:
    `StartTraceV3` (each trace's info) and OTLP span ingestion (`log_spans`: many traces in one request),
    the first with an empty request, the second with one span for the Default experiment. 404 is "no such
    endpoint"; an endpoint that exists takes the request or rejects it."""
    import urllib.error
    import urllib.request

    from mlflow.tracing.utils.otlp import MLFLOW_EXPERIMENT_ID_HEADER, OTLP_TRACES_PATH
    from mlflow.utils.rest_utils import _V3_TRACE_REST_API_PATH_PREFIX
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = ExportTraceServiceRequest()
    now = time.time_ns()
    spans.resource_spans.add().scope_spans.add().spans.add(
        trace_id=os.urandom(16), span_id=os.urandom(8), name="probe", start_time_unix_nano=now, end_time_unix_nano=now
    )

    asks = {
        "start trace": (_V3_TRACE_REST_API_PATH_PREFIX, b"{}", {"Content-Type": "application/json"}),
        "spans": (
            OTLP_TRACES_PATH,
            spans.SerializeToString(),
            {"Content-Type": "application/x-protobuf", MLFLOW_EXPERIMENT_ID_HEADER: "0"},
        ),
    }
    out = {}
    for what, (path, body, headers) in asks.items():
        req = urllib.request.Request(url + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                out[what] = r.status
        except urllib.error.HTTPError as exc:
            out[what] = exc.code
    return out


@pytest.mark.slow
def test_real_mlflow_server_version_and_api(tmp_path):
    import mlflow

    sys.path.insert(0, str(REPO / "tests"))
    from _mlflow_server import MlflowServer

    srv = MlflowServer(tmp_path)
    srv.start()
    try:
        res = checks(["trainer.logger=[mlflow]"], clean_env(MLFLOW_TRACKING_URI=srv.url), tmp_path)
        endpoints = _trace_endpoints(srv.url)
    finally:
        srv.kill()
    for name in ("library", "endpoint", "server version", "API"):
        assert find(res, "mlflow", name).status == "ok", res
    assert find(res, "mlflow", "server version").detail.startswith(f"server MLflow {mlflow.__version__}")
    # the verdict is right: the server takes both the trace infos and the spans in batches
    assert endpoints["start trace"] != 404 and endpoints["spans"] == 200, endpoints


@pytest.mark.slow
def test_cli_every_endpoint_dead_is_bounded_and_exits_1(tmp_path):
    with blackhole() as hole:
        env = clean_env(
            MLFLOW_TRACKING_URI=f"http://127.0.0.1:{hole}",
            WANDB_API_KEY=SECRET,
            WANDB_BASE_URL=f"http://127.0.0.1:{hole}",
            SWANLAB_API_KEY=SECRET,
            SWANLAB_API_HOST=f"http://127.0.0.1:{dead_port()}",
            WF_TRACE_SERVER_URL=f"http://127.0.0.1:{hole}",
            XDG_CACHE_HOME=str(tmp_path / "cache"),
            NETRC=str(tmp_path / "x"),
        )
        p, took = doctor_cli(
            [
                "trainer.logger=[console,wandb,mlflow,swanlab,weave,otlp,file]",
                f"+otel_rl.otlp_endpoint=http://127.0.0.1:{hole}",
                f"+otel_rl.jsonl_path={tmp_path}/m.jsonl",
                "--json",
            ],
            env,
        )
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is False
    failed = {c["subject"] for c in doc["checks"] if c["status"] == "fail"}
    assert failed == {"wandb", "mlflow", "swanlab", "weave", "otlp"}
    assert SECRET not in p.stdout
    assert took <= 10, took  # the documented bound: every step of every endpoint at most --timeout (3 s)


@pytest.mark.slow
def test_cli_all_fine_exits_0_and_prints_one_line_per_check(tmp_path):
    env = clean_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    p, _ = doctor_cli(["trainer.logger=[console,file]", f"+otel_rl.jsonl_path={tmp_path}/m.jsonl"], env)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("otel-rl doctor: exporters console, file")
    assert all(line.startswith("✓ ") for line in lines[1:-1]), lines
    assert lines[-1].endswith("0 failed, 0 to look at")


@pytest.mark.slow
def test_cli_dns_failure_with_a_resolver_that_does_not_answer(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a private resolv.conf needs a mount namespace (root)")
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    env = clean_env(
        MLFLOW_TRACKING_URI="http://mlflow.corp.example:5000",
        XDG_CACHE_HOME=str(tmp_path / "c"),
        PYTHONPATH=os.environ.get("PYTHONPATH", str(REPO)),
    )
    script = f"mount --bind {conf} /etc/resolv.conf && exec {VENV_BIN / 'otel-rl'} doctor 'trainer.logger=[mlflow]'"
    p = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if "mlflow: endpoint" in x)
    assert "DNS:" in line and "mlflow.corp.example" in line


class _Server:
    """A local HTTP(S) server in a thread, answering GET paths from `routes` (path -> (status, body))."""

    def __init__(self, routes: dict[str, tuple[int, bytes]], certfile: str | None = None) -> None:
        import http.server
        import ssl
        import threading

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                status, body = routes.get(self.path.split("?", 1)[0], (404, b""))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        if certfile:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(certfile)
            self.srv.socket = ctx.wrap_socket(self.srv.socket, server_side=True)
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


#: older MLflow servers, each in its own venv that `scripts/bootstrap.sh --test` builds from
#: scripts/mlflow-<version>-requirements.txt; what the doctor says of each, and what the server answers on the
#: client's trace paths (`_trace_endpoints`): 2.x has neither (an MLflow 3 client falls back to the 2.0 trace
#: API, which stores each trace under an id the server makes, not the client's: a trace sent again is stored
#: twice); 3.0-3.3 take each trace's info but no spans in batches (one trace at a time)
OLD_SERVERS = [
    ("2.22.1", "fail", "no trace API for this client", {"start trace": 404, "spans": 404}),
    ("3.2.0", "warn", "no span ingestion before 3.4", {"spans": 404}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("version", "status", "words", "answers"), OLD_SERVERS)
def test_old_mlflow_server_is_told(tmp_path, version, status, words, answers):
    sys.path.insert(0, str(REPO / "tests"))
    from _mlflow_server import MlflowServer

    bin_dir = REPO / ".cache" / f"mlflow-{version}-venv" / "bin"
    assert (bin_dir / "mlflow").exists(), (
        f"no MLflow {version} server at {bin_dir}: run `bash scripts/bootstrap.sh --test` "
        f"(it builds it from scripts/mlflow-{version}-requirements.txt)"
    )
    srv = MlflowServer(tmp_path, bin_dir=bin_dir)
    srv.start()
    try:
        res = checks(["trainer.logger=[mlflow]"], clean_env(MLFLOW_TRACKING_URI=srv.url), tmp_path)
        endpoints = _trace_endpoints(srv.url)
    finally:
        srv.kill()
    c = find(res, "mlflow", "server version")
    assert c.status == status and words in c.detail and f"MLflow {version}" in c.detail, c
    assert find(res, "mlflow", "API").status == "ok", res
    # the verdict is the server's: the paths it lacks answer 404, the others exist
    for what, code in endpoints.items():
        assert (code == 404) == (answers.get(what) == 404), (version, endpoints)


def test_untrusted_tls_certificate_is_named(tmp_path):
    cert = tmp_path / "self-signed.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(cert),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    srv = _Server({"/health": (200, b"OK")}, certfile=str(cert))
    try:
        env = clean_env(MLFLOW_TRACKING_URI=f"https://127.0.0.1:{srv.port}")
        c = find(checks(["trainer.logger=[mlflow]"], env, tmp_path), "mlflow", "endpoint")
    finally:
        srv.close()
    assert c.status == "fail" and "TLS: certificate of 127.0.0.1 not trusted" in c.detail, c
    assert "REQUESTS_CA_BUNDLE" in c.fix


def test_trickling_server_is_cut_off_at_the_timeout(tmp_path):
    import socket
    import threading

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    stop = threading.Event()

    def serve() -> None:
        # a status line, then one header line every 0.2 s, never the end of the headers
        while not stop.is_set():
            try:
                c, _ = lsock.accept()
            except OSError:
                return
            with c:
                try:
                    c.recv(4096)
                    c.sendall(b"HTTP/1.1 200 OK\r\n")
                    while not stop.wait(0.2):
                        c.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        t0 = time.monotonic()
        res = checks(
            ["trainer.logger=[mlflow]"],
            clean_env(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{lsock.getsockname()[1]}"),
            tmp_path,
            timeout=1.0,
        )
        took = time.monotonic() - t0
    finally:
        stop.set()
        lsock.close()
    c = find(res, "mlflow", "endpoint")
    assert c.status == "fail" and "no answer within 1 s" in c.detail and "trickles" in c.detail, c
    assert find(res, "mlflow", "library").status == "ok"  # the subject's other lines are kept
    assert took < 2.5, took


def test_a_check_still_running_at_the_bound_fails_its_subject_only(tmp_path, monkeypatch):
    import threading

    from otel_rl import doctor

    release = threading.Event()

    def stuck(cfg, env, timeout, min_free):
        release.wait(30)
        return []

    monkeypatch.setitem(doctor.EXPORTER_CHECKS, "file", stuck)
    t0 = time.monotonic()
    try:
        res = checks(["trainer.logger=[file]"], clean_env(), tmp_path, timeout=0.5)
        took = time.monotonic() - t0
    finally:
        release.set()
    assert doctor.time_bound(0.5) == 3.0 and 3.0 <= took < 4.0, took
    c = find(res, "file", "time")
    assert c.status == "fail" and "did not finish within 3 s" in c.detail
    assert find(res, "spool", "directory").status == "ok" and find(res, "log level")


@pytest.mark.slow
def test_cli_every_endpoint_dead_behind_a_silent_dns_server_within_10_s(tmp_path):
    """The resolver itself is dead (answers nothing; glibc's own wait is 5 s x 2 attempts): the doctor still
    ends within its bound, not when the resolver gives up."""
    import socket

    if os.geteuid() != 0:
        pytest.skip("a private resolv.conf needs a mount namespace, and a DNS port, root")
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        silent.bind(("127.0.0.77", 53))  # takes the queries, never answers
    except OSError as exc:
        pytest.skip(f"cannot bind a DNS port on 127.0.0.77: {exc}")
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.77\n")  # glibc's defaults: timeout 5 s, 2 attempts
    env = clean_env(
        MLFLOW_TRACKING_URI="http://mlflow.corp.example:5000",
        WANDB_API_KEY=SECRET + "x" * 10,
        SWANLAB_API_KEY=SECRET,
        WF_TRACE_SERVER_URL="https://weave.corp.example",
        XDG_CACHE_HOME=str(tmp_path / "c"),
        NETRC=str(tmp_path / "x"),
        PYTHONPATH=os.environ.get("PYTHONPATH", str(REPO)),
    )
    script = (
        f"mount --bind {conf} /etc/resolv.conf && exec {VENV_BIN / 'otel-rl'} doctor --json "
        "'trainer.logger=[console,wandb,mlflow,swanlab,weave,otlp]' "
        "+otel_rl.otlp_endpoint=http://otlp.corp.example:4318"
    )
    try:
        t0 = time.monotonic()
        p = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    finally:
        silent.close()
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    dns = {c["subject"] for c in doc["checks"] if c["status"] == "fail" and "DNS: no answer" in c["detail"]}
    assert dns == {"wandb", "mlflow", "swanlab", "weave", "otlp"}, doc
    assert took <= 10, took


def test_cli_bad_arguments_exit_2(tmp_path):
    from otel_rl import cli

    assert cli.main(["doctor", "--min-free", "lots"]) == 2
    assert cli.main(["doctor", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_library_version_outside_the_plugins_requirement_fails(tmp_path, monkeypatch):
    """A plug-in whose metadata wants another tracker version than the installed one (a dist-info on sys.path,
    read through importlib.metadata as pip leaves it)."""
    from otel_rl.doctor import check_library, dist_version

    have = dist_version("mlflow")
    for name, req in (("otel_rl_oldplug", "mlflow<3"), ("otel_rl_okplug", "mlflow>=3.0")):
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nRequires-Dist: {req}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = check_library("mlflow", "mlflow", "otel_rl_oldplug")
    assert [c.status for c in bad] == ["fail"]
    assert bad[0].detail == f"mlflow {have} installed; otel_rl_oldplug needs mlflow<3"
    assert bad[0].fix == "run `pip install 'mlflow<3'`"
    ok = check_library("mlflow", "mlflow", "otel_rl_okplug")
    assert [c.status for c in ok] == ["ok"] and "(needs >=3.0)" in ok[0].detail
    missing = check_library("mlflow", "mlflow", "otel_rl_not_installed")
    assert missing[0].status == "fail" and missing[0].detail == "otel_rl_not_installed is not installed"
