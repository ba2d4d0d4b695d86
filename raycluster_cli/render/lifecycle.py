"""The cluster's life on the terminal: what `up` did, what `down` removed, and `status`'s view of nodes, models and the service;
rich imported where it draws (a `--json` run never loads it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raycluster_cli.render.base import Output, _mark, _table, host_error
from raycluster_cli.render.text import remote_text, terminal_safe

if TYPE_CHECKING:
    from rich.console import Group, RenderableType


def render_up(output: Output, body: dict[str, Any]) -> None:
    table = _table(title="Ray nodes", title_justify="left")
    table.add_column("host", min_width=15)
    for column in ("role", "node IP", "alive", "action", "CPU", "GPU", "other resources"):
        table.add_column(column)
    for node in body["nodes"]:
        resources = node.get("resources", {})
        action = node.get("action", "")
        table.add_row(
            remote_text(node["host"]),
            remote_text(node["role"]),
            remote_text(node["node_ip"]),
            "[green]yes[/green]" if node["alive"] else "[red]no[/red]",
            remote_text(action),
            f"{resources.get('CPU', 0):g}",
            f"{resources.get('GPU', 0):g}",
            remote_text(_other_resources(resources)),
        )
    output.out.print(table)
    for node in body["nodes"]:
        if node.get("reason"):
            output.line(f"{remote_text(node['host'])}: {remote_text(node['action'])}: {remote_text(node['reason'])}")
    for item in body.get("images", []):
        output.line(
            f"image {remote_text(item['method'])}ed to {remote_text(item['host'])} ({remote_text(item['reason'])}): "
            f"{item['bytes_sent'] / 1e6:.0f} MB {remote_text(item['codec'])} in {item['seconds']:.0f}s"
            + (f" from {remote_text(item['source'])}" if item.get("source") else "")
            + (", its archive's SHA-256 checked on arrival" if item.get("checksum") == "sha256" else "")
        )
    if all(n.get("action") == "running" for n in body["nodes"]) and not body.get("images"):
        output.line("nothing to do: every node was already running as the inventory asks")
    if body.get("service_grown") is not None:
        grown = ", ".join(str(i) for i in body["service_grown"]) or "none (the new nodes fill no pipeline yet)"
        output.line(f"the service took the started node(s) in; new pipeline(s): {grown}")
    for warning in body.get("warnings", []):
        output.line(f"[bold yellow]warning:[/bold yellow] {remote_text(warning)}")
    output.line(f"cluster up in {body['seconds']:.1f}s")
    steps = body.get("next", {})
    if steps:
        output.line("next:")
        output.line(f"  Ray address     {remote_text(steps['ray_address'])}")
        output.line(f"  dashboard       {remote_text(steps['dashboard_url'])}")
        output.line(f"  submit a job    {remote_text(steps['submit_job'])}")
        output.line(f"  health / logs   {remote_text(steps['status'])}  ·  {remote_text(steps['logs'])}")


def _other_resources(resources: dict[str, Any]) -> str:
    skip = {"CPU", "GPU", "memory", "object_store_memory"}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if k not in skip)


def render_down(output: Output, body: dict[str, Any]) -> None:
    if body.get("drained"):
        render_drain(output, body["drained"])
    if not body["removed"]:
        output.line("nothing to remove: no container of this cluster on any host")
    for item in body["removed"]:
        output.line(f"removed {remote_text(item['container'])} on {remote_text(item['host'])}")
    for item in body.get("purged", []):
        output.line(f"purged {remote_text(item['item'])} on {remote_text(item['host'])}")
    for item in body["errors"]:
        output.line(f"[red]not removed on {remote_text(item['host'])}:[/red] {remote_text(item['error'])}")


def render_drain(output: Output, body: dict[str, Any]) -> None:
    """What `drain`/`undrain` did to the service: the pipelines taken off the node or grown over it, the streams."""
    host = remote_text(str(body.get("host")))
    if body.get("action") == "undrained":
        grown = ", ".join(str(i) for i in body.get("grown") or []) or "none (no node was free for one)"
        output.line(f"{host} let back into the service; new pipeline(s): {grown}")
    elif not body.get("drained"):
        output.line(f"{host} drained: {remote_text(body.get('note') or 'no pipeline ran on it')}")
    else:
        pipelines = ", ".join(str(i) for i in body["drained"])
        by = ", ".join(str(i) for i in body.get("replaced_by") or []) or "none (the others serve)"
        output.line(
            f"{host} drained in {body.get('seconds', 0):g} s: pipeline(s) {pipelines} replaced by {by}; "
            f"{body.get('finished', 0)} stream(s) finished there, {body.get('moved', 0)} moved at the deadline"
        )
    if body.get("note") and body.get("action") == "undrained":
        output.line(remote_text(body["note"]))


def render_status(output: Output, body: dict[str, Any]) -> None:
    output.out.print(status_view(body))


def status_view(body: dict[str, Any], title: str = "") -> Group:
    """The node table of `status` with its summary lines (also what `status --watch` redraws)."""
    title = title or f"cluster {remote_text(body['cluster'])}: {remote_text(body['state'])}"
    table = _table(title=title, title_justify="left")
    table.add_column("host", min_width=15)
    table.add_column("role")
    table.add_column("container", min_width=9)
    for column in ("Ray node", "CPU", "GPU", "other resources"):
        table.add_column(column)
    table.add_column("image", min_width=12)
    table.add_column("Ray", min_width=6)
    for host in body["hosts"]:
        resources = host.get("resources", {})
        good = {"running", "alive"}
        table.add_row(
            remote_text(host["host"]),
            remote_text(host["role"]),
            _mark(host["container"], host["container"] in good),
            _mark(host["ray_node"], host["ray_node"] in good),
            f"{resources.get('CPU', 0):g}",
            f"{resources.get('GPU', 0):g}",
            remote_text(_other_resources(resources)),
            remote_text(terminal_safe(str(host["image_id"]))[7:19]),
            remote_text(host["ray_version"]),
        )
    totals = body["totals"]
    summary = ", ".join(f"{k} {v:g}" for k, v in totals["resources"].items() if k in {"CPU", "GPU"})
    from rich.console import Group
    from rich.text import Text

    lines: list[RenderableType] = [
        table,
        Text.from_markup(f"{totals['alive_nodes']}/{totals['hosts']} nodes alive; {summary or 'no resources'}"),
    ]
    lines.extend(Text(terminal_safe(line)) for line in _model_lines(body["hosts"]))
    for host in body["hosts"]:
        if host.get("error"):
            lines.append(
                Text.from_markup(
                    f"[red]{remote_text(host['host'])}:[/red] {remote_text(host_error(host['host'], host['error']))}"
                )
            )
    service = _service_line(body.get("service"), body.get("service_error", ""))
    if service:
        lines.append(Text.from_markup(service))
    lines.extend(Text(terminal_safe(line)) for line in _live_lines((body.get("service") or {}).get("live")))
    return Group(*lines)


def _live_lines(live: dict[str, Any] | None) -> list[str]:
    """The service's pipelines now (each one's state, requests served, its stages' nodes, blocks or parts, and
    devices) and its last event."""
    if not live:
        return []
    lines = []
    for pipeline in live.get("pipelines") or []:
        stages = " | ".join(
            f"{st.get('node_ip') or '?'} "
            + (f"{st['blocks']} block(s)" if st.get("blocks") is not None else "+".join(st.get("parts") or []))
            + (f" on {st['device']}" if st.get("device") else "")
            for st in pipeline.get("stages") or []
        )
        served = pipeline.get("served", pipeline.get("images"))
        links = f", {pipeline['links']} links" if pipeline.get("links") else ""
        lines.append(f"  pipeline {pipeline.get('index')} ({pipeline.get('state')}, served {served}{links}): {stages}")
        if pipeline.get("links_note"):
            lines.append(f"    {pipeline['links_note']}")
    drained = [str(d.get("node")) for d in live.get("drained") or [] if isinstance(d, dict)]
    if drained:
        lines.append(f"  drained (no stage goes there until raycluster undrain): {', '.join(drained)}")
    events = live.get("events") or []
    if events:
        last = events[-1]
        lines.append(f"  last event: {last.get('event')} {last.get('detail', '')}".rstrip())
    return lines


def _model_lines(hosts: list[dict[str, Any]]) -> list[str]:
    """One line per model held on any host: its name, digest and size, and which hosts hold it."""
    holders: dict[str, list[str]] = {}
    about: dict[str, dict[str, Any]] = {}
    for host in hosts:
        for model in host.get("models") or []:
            holders.setdefault(model["digest"], []).append(host["host"])
            about.setdefault(model["digest"], model)
    lines = []
    for digest, on in holders.items():
        model = about[digest]
        size = f", {model['size'] / 1e6:.1f} MB" if isinstance(model.get("size"), int) else ""
        lines.append(
            f"model {model.get('name') or '?'} ({terminal_safe(str(digest))[:12]}{size}) on {len(on)}/{len(hosts)}: "
            + ", ".join(on)
        )
    return lines


def _service_line(service: dict[str, Any] | None, error: str) -> str:
    """`serve`'s service in one line: its model, URL and replicas, and Ray Serve's status of it."""
    if error:
        return f"[yellow]service: could not be read: {remote_text(error)}[/yellow]"
    if not service:
        return "no service (raycluster serve --model-path DIR starts one)"
    record = service.get("record") or {}
    state = (service.get("serve") or {}).get("status") or "not deployed"
    colour = "green" if state == "RUNNING" else "yellow"
    replicas = sum(
        d.get("replicas", {}).get("RUNNING", 0)
        for d in ((service.get("serve") or {}).get("deployments") or {}).values()
    )
    what = (
        f"{remote_text(str(record.get('model', '?')))} at {remote_text(str(record.get('url', '?')))}" if record else "?"
    )
    what += " (images)" if record.get("kind") == "image" else ""
    return f"service: {what}: [{colour}]{remote_text(state)}[/{colour}], {replicas} running deployment replica(s)"
