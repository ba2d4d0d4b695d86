"""Rendering of the operating verbs: exec, submit, dashboard, metrics, status --watch."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.live import Live
from rich.table import Table

from raycluster_cli.render.base import Output, host_error
from raycluster_cli.render.lifecycle import status_view
from raycluster_cli.render.text import remote_text, terminal_safe
from raycluster_cli.transport.stream import Stream


class ExecPrinter:
    """Prints each output line of `exec` as it arrives: stdout lines to stdout, stderr lines to stderr,
    prefixed with the host when several hosts run the command (as pdsh does)."""

    def __init__(self, output: Output, prefixed: bool) -> None:
        self.output = output
        self.prefixed = prefixed
        self.width = 0

    def __call__(self, host: str, stream: Stream, line: str) -> None:
        if self.output.json_mode:
            return
        target = self.output.stdout if stream == "stdout" else self.output.err.file
        prefix = f"{terminal_safe(host):<15} | " if self.prefixed else ""
        target.write(prefix + terminal_safe(line) + "\n")
        target.flush()


def render_exec(output: Output, body: dict[str, Any]) -> None:
    """After the streamed lines: each host that could not run the command, and each non-zero exit status."""
    several = len(body["hosts"]) > 1
    for host in body["hosts"]:
        if host["error"]:
            error = host_error(host["host"], host["error"])
            output.err.print(f"[bold red]{remote_text(host['host'])}:[/bold red] {remote_text(error)}", markup=True)
        elif several and host["rc"] != 0:
            output.err.print(f"[yellow]{remote_text(host['host'])}: exit status {host['rc']}[/yellow]", markup=True)


class JobLogPrinter:
    """Writes each new piece of a job's log as it arrives: to stdout, or to stderr under --json."""

    def __init__(self, output: Output) -> None:
        self.output = output

    def __call__(self, text: str) -> None:
        target = self.output.err.file if self.output.json_mode else self.output.stdout
        target.write(terminal_safe(text))
        target.flush()


def render_submit(output: Output, body: dict[str, Any]) -> None:
    job = body["job"]
    if not job["waited"]:
        output.err.print(f"job {terminal_safe(str(job['submission_id']))} accepted (not waiting for it)", markup=False)
        return
    colour = "green" if job["status"] == "SUCCEEDED" else "red"
    code = job["driver_exit_code"]
    detail = f", driver exit code {code}" if code is not None else ""
    # The dashboard's strings are remote input: escaped for the terminal and for rich's markup.
    output.err.print(
        f"job {remote_text(str(job['submission_id']))}: [{colour}]{remote_text(str(job['status']))}[/{colour}]{detail}"
        + (
            f" — {remote_text(job['message'].splitlines()[0])}"
            if job["status"] != "SUCCEEDED" and job["message"]
            else ""
        ),
        markup=True,
    )


def render_interrupted_job(output: Output, cluster: str, job: Any, stop: str) -> int:
    """Ctrl-C while following a job: it keeps running on the cluster; say how to stop it. Returns 130."""
    if output.json_mode:
        body = {"cluster": cluster, "job": job.to_dict(), "interrupted": True, "stop_command": stop}
        output.document(False, body)
    output.error(f"interrupted; job {job.submission_id} keeps running on the cluster", f"to stop it: {stop}")
    return 130


def render_dashboard(output: Output, body: dict[str, Any]) -> None:
    output.line(f"dashboard of cluster {remote_text(body['cluster'])}: {remote_text(body['url'])}")
    output.err.print(
        f"forwarding 127.0.0.1 → {terminal_safe(str(body['head_dashboard']))} over SSH (Ray {terminal_safe(str(body['ray_version']))}); "
        "Ctrl-C to stop",
        markup=False,
    )
    if body.get("auth_token_file"):
        output.err.print(
            f"the dashboard asks for the cluster's token: paste the content of {remote_text(body['auth_token_file'])}"
        )


@contextmanager
def live_status(output: Output) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A callback that redraws the status table in place (rich Live) with the time of each refresh."""
    with Live(console=output.out, auto_refresh=False, transient=False) as live:

        def show(body: dict[str, Any]) -> None:
            title = (
                f"cluster {remote_text(body['cluster'])}: {remote_text(body['state'])} "
                f"at {time.strftime('%H:%M:%S')} (Ctrl-C to stop)"
            )
            live.update(status_view(body, title), refresh=True)

        yield show


def render_metrics(output: Output, body: dict[str, Any]) -> None:
    table = Table(title=f"Prometheus targets of cluster {remote_text(body['cluster'])}", title_justify="left")
    for column in ("target", "host", "role", "Ray lists it", "scrape"):
        table.add_column(column)
    for target in body["targets"]:
        scrape = (
            f"[green]{target['samples']} samples[/green]"
            if target["up"]
            else f"[red]{remote_text(target['error'])}[/red]"
        )
        table.add_row(
            remote_text(target["target"]),
            remote_text(target["host"] or "(dashboard)"),
            remote_text(target.get("role", "")),
            "yes" if target["in_ray_list"] else "[yellow]no[/yellow]",
            scrape,
        )
    output.out.print(table)
    for path in body["files"]:
        output.line(f"wrote {remote_text(path)}")
    if body["dashboards"]:
        output.line(f"wrote {len(body['dashboards'])} Grafana dashboards to {remote_text(body['dashboards_dir'])}")
    for warning in body["warnings"]:
        output.line(f"[bold yellow]warning:[/bold yellow] {remote_text(warning)}")


def render_serve(output: Output, body: dict[str, Any]) -> None:
    """Where the service answers, what it serves, and how to call it (the token by its file, never its value)."""
    sent = [c for c in body["copies"] if c["action"] == "sent"]
    if body["copies"]:
        already = len(body["copies"]) - len(sent)
        here = sum(str(c.get("source", "")).startswith("operator") for c in sent)
        relayed = f" ({here} from here, {len(sent) - here} host to host)" if sent else ""
        if reused := max((int(c.get("files_reused", 0)) for c in sent), default=0):  # only the changed files went
            relayed += f", {reused} file(s) reused from the models they hold"
        digest = terminal_safe(str(body["model_digest"]))[:12]
        output.line(f"model {remote_text(digest)}: sent to {len(sent)} host(s){relayed}, already on {already}")
    model, url = remote_text(body["model"]), remote_text(body["url"])
    output.line(f"serving {model} at {url} ({body['replicas']} replica(s)), ready in {body['seconds']:.0f}s")
    for index, pipeline in enumerate(body.get("pipelines") or []):
        stages = ", ".join(
            f"{st.get('host', st.get('node_ip', '?'))}: "
            + ("+".join(map(str, st["parts"])) if "parts" in st else f"{st.get('blocks', '?')} block(s)")
            for st in pipeline.get("stages", [])
        )
        if "s_per_image" in pipeline:
            stages += f", {pipeline['s_per_image']:.2f} s/image"
        why = f" ({pipeline['why']})" if pipeline.get("why") else ""
        output.line(f"replica {index}: {remote_text(stages + why)}")
    if not body.get("pipelines"):
        output.line(f"split: {remote_text(body['split'])}")
    output.line(
        "call it with the service's key (never the cluster's token; raycluster serve --keys add NAME for more):"
    )
    for command in call_commands(body):
        output.line("  " + remote_text(command))
    output.line("raycluster status shows it; raycluster serve --stop removes it")
    output.line(METRICS_HINT)


def call_commands(body: dict[str, Any]) -> list[str]:
    """The commands that call the service, to copy and paste: every value in them (the model's name, the URL, the
    key's file) quoted for the shell, and for Python inside `python -c`, so a model named `x'; rm -rf ~ #`
    stays a name."""
    model, url = terminal_safe(str(body["model"])), terminal_safe(str(body["url"]))  # as `serving` showed them
    commands = []
    if body.get("api_key_file"):
        commands.append(f'export OPENAI_API_KEY="$(cat {shlex.quote(str(body["api_key_file"]))})"')
    if body.get("tls_cert_file"):  # the clients verify the service with its certificate (python's ssl, curl)
        cert = shlex.quote(str(body["tls_cert_file"]))
        commands.append(f"export SSL_CERT_FILE={cert} CURL_CA_BUNDLE={cert}")
    if body.get("kind") == "image":
        program = (
            'import base64, openai; open("out.png", "wb").write(base64.b64decode(openai.OpenAI('
            f"base_url={json.dumps(url)}).images.generate(model={json.dumps(model)}, "
            'prompt="a red house").data[0].b64_json))'
        )
        return [*commands, f"python -c {shlex.quote(program)}"]
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}]})
    commands.append(
        f'curl -s {shlex.quote(url + "/chat/completions")} -H "Authorization: Bearer $OPENAI_API_KEY" '
        f"-H 'Content-Type: application/json' -d {shlex.quote(chat)}"
    )
    program = (
        f"import openai; print(openai.OpenAI(base_url={json.dumps(url)}).completions.create("
        f'model={json.dumps(model)}, prompt="Hello", max_tokens=16).choices[0].text)'
    )
    return [*commands, f"python -c {shlex.quote(program)}"]


METRICS_HINT = (
    "its metrics (tokens, TTFT, TPOT, each stage's busy share) go to Prometheus with Ray's:"
    " raycluster metrics --out DIR writes the targets and a Grafana dashboard"
)


def render_serve_keys(output: Output, body: dict[str, Any]) -> None:
    """`serve --keys`: the key's file (the key itself is never printed), or the keys the head knows."""
    name, cluster = remote_text(body.get("name", "")), remote_text(body["cluster"])
    if body["action"] == "added":
        output.line(f"cluster {cluster}: key {name} added, in effect now; it is in {remote_text(body['key_file'])}")
        output.line("  " + remote_text(f'export OPENAI_API_KEY="$(cat {shlex.quote(str(body["key_file"]))})"'))
    elif body["action"] == "revoked":
        output.line(f"cluster {cluster}: key {name} revoked, refused from now on")
    elif not body.get("keys"):
        output.line(f"cluster {cluster}: the service has no keys (raycluster serve deploys with one)")
    else:
        table = Table(title=f"cluster {cluster}: the service's API keys")
        for column in ("name", "created", "requests at once", "tokens at once", "key file on this machine"):
            table.add_column(column)
        for row in body["keys"]:
            created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created"])) if row["created"] else "?"
            table.add_row(
                remote_text(row["name"]),
                created,
                str(row["max_requests"] or "-"),
                str(row["max_tokens"] or "-"),
                remote_text(row["key_file"] or "(made elsewhere)"),
            )
        output.out.print(table)


def render_serve_stop(output: Output, body: dict[str, Any]) -> None:
    output.line(
        f"cluster {remote_text(body['cluster'])}: "
        + ("service removed" if body["removed"] else "no service was running")
    )
