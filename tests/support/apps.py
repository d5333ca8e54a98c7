"""Serve apps the integration tests start beside the session's server, and the health wait every start uses."""

from __future__ import annotations

import time

import httpx
import psutil


def healthy(url: str) -> bool:
    """Whether the app at `url` answers its /health with 200 (every engine answered) now."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become healthy")
        time.sleep(1)


def run_app(args: dict, name: str, base_url: str) -> str:
    """Deploy `build_app(args)` as app `name` under the route prefix `/name` of the running Serve instance and
    return its URL once healthy."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    url = f"{base_url}/{name}"
    wait_healthy(url, f"the {name} app")
    return url


def replica_urls(name: str, deployment: str = "Ingress") -> list[str]:
    """App `name`'s `deployment` replicas' own HTTP addresses (direct ingress), past Serve's HAProxy: to tell what
    a replica does from what the front door does."""
    urls = []
    for proc in psutil.process_iter(["cmdline"]):
        if f"ServeReplica:{name}:{deployment}" not in " ".join(proc.info["cmdline"] or []):
            continue
        for conn in proc.net_connections(kind="tcp"):
            if conn.status != psutil.CONN_LISTEN:
                continue
            host = conn.laddr.ip if conn.laddr.ip not in ("0.0.0.0", "::") else "127.0.0.1"
            url = f"http://{host}:{conn.laddr.port}/{name}"
            if healthy(url):
                urls.append(url)
                break
    return urls


def replica_url(name: str, deployment: str = "Ingress") -> str:
    urls = replica_urls(name, deployment)
    if not urls:
        raise RuntimeError(f"no {deployment} replica of app {name} answers on its own port")
    return urls[0]
