"""The operator's side of `serve`: the model onto the hosts, the service deployed from the head's container, what
it is doing now, and its end.

The service itself is node side (raycluster_cli/serve/: Ray Serve, the stages, the OpenAI routes). `serve` puts the
model where every node can read it (delivery/model_relay.py: a folder on this machine is relayed into each host's
model cache, mounted read-only into the Ray containers; a path that is not on this machine is taken as one on the
nodes), then
runs the launcher (`python -m raycluster_cli.serve`) in the head's container with its options (serve/options.py's
LaunchOptions, the same model the CLI's flags are) as a JSON file there: it deploys the Ray Serve application
and returns once a real generation went through every stage. The application outlives the launcher and this
process (Ray Serve keeps it), so closing the operator's laptop does not stop it; `serve --stop` removes it. The
launcher's document is kept in the head's container, for `status`. Never prints.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from raycluster_cli.config.inventory import Inventory
from raycluster_cli.delivery.model_relay import ModelCopy, place_model
from raycluster_cli.delivery.models import ModelFolder
from raycluster_cli.errors import OperationError, UsageError
from raycluster_cli.host.containers import REVIVE_RECORD, SOURCE_ENV, TOKEN_IN_CONTAINER, container_name
from raycluster_cli.progress import Progress, quiet
from raycluster_cli.serve.options import LaunchOptions, ServeOptions
from raycluster_cli.transport import Transport, quote
from raycluster_cli.transport.pool import Connect
from raycluster_cli.verbs import serve_keys, served_model
from raycluster_cli.verbs.serve_keys import KEYS_IN_CONTAINER

APP = "raycluster"  # the Ray Serve application's name (the launcher's APP_NAME)
RECORD = "/tmp/raycluster-serve.json"  # the launcher's document, in the head's container
LAUNCH_OPTIONS = "/tmp/raycluster-serve-options.json"  # the launcher's options (LaunchOptions), in the head's container
_FLAG = re.compile(r"pass (--[a-z][a-z-]*(?: \S+)?)")  # a launcher error that names its fix


@dataclass
class ServeResult:
    url: str
    model: str
    replicas: int
    split: Any
    model_path: str  # where the nodes read it
    model_digest: str | None
    pipelines: list[dict[str, Any]] = field(default_factory=list)  # per replica: its stages, their nodes, and why
    why: str = ""
    copies: list[ModelCopy] = field(default_factory=list)
    api_key_file: str | None = None  # this machine's file of the service's default key (never the Ray token)
    tls_cert_file: str | None = None  # the certificate clients verify the service with (https only)
    seconds: float = 0.0
    kind: str = "text"  # "image": a diffusers checkpoint served as /v1/images/generations

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _head(inventory: Inventory, connect: Connect) -> tuple[Transport, str]:
    return connect(inventory.head_host), quote(container_name(inventory, inventory.head_host))


def launch_options(
    inventory: Inventory, model_path: str, options: ServeOptions, tls: tuple[str, str] | None = None
) -> LaunchOptions:
    """What the launcher reads: the operator's options (less this machine's own: its key file, its deadline) with
    the model where the nodes read it, the head's address, the keys document ``put_keys`` wrote in the head's
    container and the TLS pair ``put_tls`` did; never a key."""
    return LaunchOptions.model_validate(
        {
            **options.model_dump(exclude_none=True),  # unset (stages): the launcher's default
            "model_path": model_path,
            "host": inventory.node_ip(inventory.head_host),
            "keys_file": KEYS_IN_CONTAINER,
            "record": RECORD,
            "revive": REVIVE_RECORD,
            "tls_cert": tls[0] if tls else None,
            "tls_key": tls[1] if tls else None,
        }
    )


def launcher_command() -> str:
    """The launcher's command line in the head's container (its env sourced, as the Ray processes have it), its
    options the file ``serve`` wrote there (LAUNCH_OPTIONS)."""
    return f"{SOURCE_ENV} && exec python -m raycluster_cli.serve --options @{LAUNCH_OPTIONS}"


def serve(inventory: Inventory, connect: Connect, options: ServeOptions, progress: Progress = quiet) -> ServeResult:
    """Put the model on the hosts, deploy the service (replacing one already there), return once it generates."""
    started = time.monotonic()
    if not options.model_path:
        raise UsageError("serve needs --model-path DIR (or --stop)", "e.g. raycluster serve --model-path ./my-llama")
    path, model, copies = place_model(inventory, connect, options.model_path, progress)
    if model is not None and not options.model_id:  # the nodes read it under its digest: name it as its folder
        options = options.model_copy(update={"model_id": model.root.name})
    if options.stages is None:  # the balanced pipeline across every node (no more stages than the model has blocks)
        blocks = _blocks(model) if model is not None else None
        options = options.model_copy(update={"stages": min(len(inventory.hosts), blocks or len(inventory.hosts))})
    transport, head = _head(inventory, connect)
    tls_files = _tls_files(inventory, options)
    key_path = serve_keys.put_keys(inventory, connect, options.api_key_file)
    tls = serve_keys.put_tls(inventory, connect, tls_files) if tls_files is not None else None
    progress(f"deploying the service from {inventory.head_address}'s container (returns once it generates)")
    launch = launch_options(inventory, path, options, tls)
    serve_keys.put_in_head(transport, head, LAUNCH_OPTIONS, launch.model_dump_json().encode())
    result = transport.run(f"docker exec {head} sh -c {quote(launcher_command())}", timeout=options.timeout)
    document = _last_json(result.stdout)
    if not result.ok or document is None:
        tail = (result.stderr.strip().splitlines() or [f"exit {result.rc}"])[-1]
        flag = _FLAG.search(tail)  # the launcher's own fix ("pass --max-seq 256"): the hint is that flag
        raise OperationError(
            f"{inventory.head_address}: the service did not start: {tail}",
            f"run raycluster serve again with {flag.group(1)}"
            if flag
            else f"its full output: raycluster exec -- {shlex.join(['sh', '-c', launcher_command()])}",
        )
    if model is not None:  # `up` gives a host added later its copy (verbs/served_model.py)
        served_model.remember(inventory, model)
    return ServeResult(
        url=str(document.get("url", "")),
        model=str(document.get("model", "")),
        replicas=int(document.get("replicas", 1)),
        split=document.get("split"),
        model_path=path,
        pipelines=_name_hosts(inventory, document.get("pipelines") or []),
        why=str(document.get("why", "")),
        model_digest=model.digest if model else None,
        copies=copies,
        api_key_file=str(key_path),
        tls_cert_file=str(tls_files.cert) if tls_files is not None else None,
        seconds=round(time.monotonic() - started, 2),
        kind=str(document.get("kind", "text")),
    )


def _tls_files(inventory: Inventory, options: ServeOptions) -> serve_keys.TlsFiles | None:
    """The API's TLS pair (the operator's, or self-signed here), or None for plain HTTP; a pair kept from an
    earlier HTTPS service is not reused unless asked (plain HTTP stays plain)."""
    if options.tls_cert or options.tls_key:
        if not (options.tls_cert and options.tls_key):
            raise UsageError("--tls-cert and --tls-key go together", "give both, or --tls-self-signed")
        return serve_keys.given_pair(inventory, options.tls_cert, options.tls_key)
    if options.tls_self_signed:
        return serve_keys.self_signed(inventory)
    serve_keys.forget_tls(inventory)
    return None


def _blocks(model: ModelFolder) -> int | None:
    """The checkpoint's transformer blocks, from its config.json (Llama-like and GPT-2 names)."""
    try:
        config = json.loads((model.root / "config.json").read_text())
        value = config.get("num_hidden_layers", config.get("n_layer"))
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _name_hosts(inventory: Inventory, pipelines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each stage's inventory host next to the node IP the launcher reported."""
    host_of = {inventory.node_ip(h): str(h.address) for h in inventory.hosts}
    for pipeline in pipelines:
        for stage in pipeline.get("stages", []) if isinstance(pipeline, dict) else []:
            if isinstance(stage, dict) and "node_ip" in stage:
                stage["host"] = host_of.get(str(stage["node_ip"]), stage["node_ip"])
    return pipelines


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None


# What the head's container says of the service: the launcher's record and Ray Serve's own view (the dashboard's
# REST API, with the cluster's token), one short Python without Ray's import.
_STATUS = """
import json, os, ssl, sys, urllib.request
given = json.loads(sys.stdin.read() or "{}")  # the service's key and certificate, from the operator's machine
out = {}
try:
    out["record"] = json.load(open(%(record)r))
except (OSError, ValueError):
    out["record"] = None
request = urllib.request.Request(%(url)r)
if os.path.exists(%(token)r):
    request.add_header("Authorization", "Bearer " + open(%(token)r).read().strip())
try:
    with urllib.request.urlopen(request, timeout=10) as answer:
        apps = json.load(answer).get("applications") or {}
    app = apps.get(%(app)r)
    out["serve"] = None if app is None else {
        "status": app.get("status"), "message": app.get("message", ""),
        "deployments": {name: {"status": d.get("status"), "replicas": d.get("replica_states", {})}
                        for name, d in (app.get("deployments") or {}).items()},
    }
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
service_url = (out["record"] or {}).get("url")
if service_url and out.get("serve"):  # the service's own view: its pipelines now, what they served, its events
    live = urllib.request.Request(service_url.removesuffix("/v1") + "/raycluster/status")
    if given.get("key"):
        live.add_header("Authorization", "Bearer " + given["key"])
    context = None
    if service_url.startswith("https:"):
        context = ssl.create_default_context()
        if given.get("cert"):
            context.load_verify_locations(cadata=given["cert"])
            context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    try:
        with urllib.request.urlopen(live, timeout=15, context=context) as answer:
            body = json.load(answer)
        keep = ("index", "state", "served", "images", "requests", "outstanding_tokens", "links", "links_note")
        out["live"] = {
            "replicas": body.get("replicas"), "failovers": body.get("failovers"), "drained": body.get("drained", []),
            "pipelines": [
                {k: p[k] for k in keep if k in p}
                | {"stages": [{k: st.get(k) for k in ("node_ip", "blocks", "parts", "device", "matmuls") if k in st}
                              for st in p.get("stages", [])]}
                for p in body.get("pipelines", [])
            ],
            "events": body.get("events", [])[-5:],
        }
    except Exception as exc:
        out["live_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def service_status(inventory: Inventory, connect: Connect) -> dict[str, Any] | None:
    """The service as the head sees it: None when none is deployed, else its record (url, model, split,
    replicas) and Ray Serve's status (RUNNING, DEPLOYING, UNHEALTHY …) with each deployment's replicas, and the
    service's own view (``live``): its pipelines now (a re-split or a failover changes them), each one's state,
    stages and requests served, and its last events."""
    transport, head = _head(inventory, connect)
    ray = inventory.ray
    url = f"http://{inventory.node_ip(inventory.head_host)}:{ray.dashboard_port}/api/serve/applications/"
    script = _STATUS % {"record": RECORD, "url": url, "token": TOKEN_IN_CONTAINER, "app": APP}
    cert = serve_keys.service_cert(inventory)
    given = {"key": serve_keys.read_key(inventory), "cert": cert.read_text() if cert is not None else None}
    result = transport.run(
        f"docker exec -i {head} python -c {quote(script)}", stdin=json.dumps(given).encode(), timeout=30
    )
    document = _last_json(result.stdout)
    if document is None:
        raise OperationError(
            f"{inventory.head_address}: could not read the service's state: {result.first_line() or result.rc}",
            "check the head: raycluster status",
        )
    if document.get("serve") is None and document.get("record") is None:
        return None  # nothing deployed by `serve` (Ray Serve's own answer may be an error when it never started)
    return document


def stop(inventory: Inventory, connect: Connect) -> bool:
    """Remove the service (Ray Serve's application and its stage actors) and its records in the head's container
    (the one `status` reads, the one the head deploys it again from when it starts again); whether there was one."""
    transport, head = _head(inventory, connect)
    served_model.forget(inventory)
    script = (
        "import json, ray\nfrom ray import serve\nray.init(address='auto', logging_level='ERROR')\n"
        f"had = {APP!r} in serve.status().applications\n"
        f"serve.delete({APP!r}) if had else None\nprint(json.dumps({{'removed': had}}))\n"
    )
    # the records first: a head that starts again meanwhile must not deploy what is being removed
    removal = f"rm -f {RECORD} {REVIVE_RECORD} && {SOURCE_ENV} && python -c {shlex.quote(script)}"
    command = f"docker exec {head} sh -c {quote(removal)}"
    result = transport.run(command, timeout=180)
    document = _last_json(result.stdout)
    if not result.ok or document is None:
        raise OperationError(
            f"{inventory.head_address}: the service could not be removed: {result.first_line() or result.rc}",
            "check the head: raycluster status; raycluster logs",
        )
    return bool(document.get("removed"))
