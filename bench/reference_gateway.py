"""The issue's reference gateway (LiteLLM's proxy) on this machine, measured like SVC's.

Issue 3 sizes its gateway targets by "the most used open-source OpenAI-compatible gateway"
(about 240 req/s JSON and 70 streams/s with two workers at concurrency 32, 8-9 ms added at
concurrency 1). This runs that gateway here, against the same stub and with the same client
as `bench/gateway_chat.py`, so that a machine faster or slower than the reference for this
kind of work shows up in figures of the same hour rather than in a database yardstick:

    python bench/reference_gateway.py --concurrency 1,32 --requests 2000

It installs `litellm[proxy]` into its own virtualenv (`--venv`, default
/tmp/svc-bench-litellm; needs PyPI), writes a proxy config with one model, `stub`, routed to
`bench/stub_upstream.py`, starts the proxy with `--workers` worker processes and a master
key, and runs `bench/gateway_chat.py` against it with the CPU and RSS of every proxy process
counted (`--process-tree`). The proxy persists nothing (no database configured), as in the
issue's figures. Everything it started is stopped on exit. The issue names no release; to
measure another one, give it a virtualenv of its own:

    python bench/reference_gateway.py --venv /tmp/litellm-1.60 --litellm 'litellm[proxy]==1.60.0'
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

HERE = Path(__file__).parent
MASTER_KEY = "sk-svc-bench-reference"


def ensure_litellm(venv: Path, spec: str) -> Path:
    """The proxy's command in `venv`, installing `spec` there first when it is missing."""
    command = venv / "bin" / "litellm"
    if not command.exists():
        print(f"# installing {spec} into {venv}", flush=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", spec], check=True)
        except subprocess.CalledProcessError as exc:
            raise SystemExit(
                f"could not install {spec} into {venv} ({exc}); it needs PyPI. "
                "Remove the directory and run again, or pass --venv with one that has it."
            ) from None
    return command


def version(venv: Path) -> str:
    shown = subprocess.run(
        [str(venv / "bin" / "pip"), "show", "litellm"], capture_output=True, text=True
    ).stdout
    return next(
        (
            line.split(":", 1)[1].strip()
            for line in shown.splitlines()
            if line.startswith("Version:")
        ),
        "unknown",
    )


def config(stub_port: int) -> str:
    return (
        "model_list:\n"
        "  - model_name: stub\n"
        "    litellm_params:\n"
        "      model: openai/stub\n"
        f"      api_base: http://127.0.0.1:{stub_port}/v1\n"
        "      api_key: unused\n"
        "general_settings:\n"
        f"  master_key: {MASTER_KEY}\n"
    )


def wait_until_up(
    url: str, headers: dict[str, str], process: subprocess.Popen[bytes], seconds: float = 120.0
) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"the proxy exited with status {process.returncode} (its log is above)"
            )
        with suppress(OSError):
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2):
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {seconds:.0f} s (the proxy's log is above)")


@contextmanager
def started(
    command: list[str], env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `command` in a process group of its own, so that stopping it stops its workers."""
    with log.open("w") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield process
        finally:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
            _signal_group(process, signal.SIGKILL)  # workers that outlived their master


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def installed_matches(installed: str, spec: str) -> bool:
    """Whether the `installed` release is the one `spec` pins (any, when it pins none)."""
    pinned = spec.partition("==")[2].strip()
    return not pinned or installed == pinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/svc-bench-litellm"))
    parser.add_argument("--litellm", default="litellm[proxy]", help="pip requirement")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--port", type=int, default=8796)
    parser.add_argument("--stub-port", type=int, default=8797)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--modes", default="json,stream")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    litellm = ensure_litellm(args.venv, args.litellm)
    installed = version(args.venv)  # one `pip show`: it takes about half a second
    if not installed_matches(installed, args.litellm):
        raise SystemExit(
            f"{args.venv} holds litellm {installed}, not {args.litellm}: "
            "give each release a --venv of its own"
        )
    print(f"# litellm {installed}, {args.workers} workers, no database", flush=True)
    with tempfile.TemporaryDirectory(prefix="svc-bench-litellm-") as work:
        config_path = Path(work, "config.yaml")
        config_path.write_text(config(args.stub_port))
        # No internet here: the proxy's model cost map is read from its own package.
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        stub_cmd = [
            sys.executable,
            str(HERE / "stub_upstream.py"),
            "--port",
            str(args.stub_port),
            "--tokens",
            "16",
        ]
        proxy_cmd = [
            str(litellm),
            "--config",
            str(config_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(args.port),
            "--num_workers",
            str(args.workers),
        ]
        with (
            started(stub_cmd, env, Path(work, "stub.log")) as stub,
            started(proxy_cmd, env, Path(work, "proxy.log")) as proxy,
        ):
            headers = {"Authorization": f"Bearer {MASTER_KEY}"}
            try:
                wait_until_up(f"http://127.0.0.1:{args.port}/v1/models", headers, proxy)
            except SystemExit:
                print(Path(work, "proxy.log").read_text()[-4000:], file=sys.stderr)
                raise
            client = [
                sys.executable,
                str(HERE / "gateway_chat.py"),
                "--gateway",
                f"http://127.0.0.1:{args.port}",
                "--stub",
                f"http://127.0.0.1:{args.stub_port}/v1",
                "--key",
                MASTER_KEY,
                "--model",
                "stub",
                "--label",
                "litellm",
                "--gateway-pid",
                str(proxy.pid),
                "--process-tree",
                "--stub-pid",
                str(stub.pid),
                "--concurrency",
                args.concurrency,
                "--modes",
                args.modes,
                "--requests",
                str(args.requests),
            ]
            if args.quick:
                client.append("--quick")
            subprocess.run(client, check=True)


if __name__ == "__main__":
    main()
