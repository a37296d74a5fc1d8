"""The Docker deployment of docker/compose_gen.py, driven through docker-compose.

``Compose`` writes the generated compose file and fresh credentials (one folder per
container, given to the images' non-root user) into a work folder, brings the project up
under its own name (its own networks and volumes), runs ``flwr`` against the SuperLink
from the operator's side (127.0.0.1:9091), and removes everything it made on ``close``.
The images must exist (``make deploy-test`` builds them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from fedpers.simulations.launch import flower_environment, staged_app
from tests.deployment.cluster import BIN, PROJECT, load_script, write_run_config

DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


def docker(
    *args: str, timeout: float = 120, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the Docker CLI."""
    return subprocess.run(
        [DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=check
    )


class Compose:
    """One compose project of a SuperLink, its Fleet proxy and ``nodes`` SuperNodes."""

    def __init__(self, work: Path, *, nodes: int = 3, isolation: str = "subprocess") -> None:
        self.entrypoint = load_script("entrypoint")
        self.compose_gen = load_script("compose_gen")
        credentials = load_script("credentials")
        self.work = work
        self.nodes = nodes
        self.project = f"fedpers{os.getpid() % 100000}"
        folder = work / "docker"
        folder.mkdir(parents=True, exist_ok=True)
        self.file = folder / "docker-compose.yml"
        self.file.write_text(self.compose_gen.compose(nodes))
        self.files = [self.file]
        self.credentials = credentials.make_credentials(
            folder / "credentials", ips=[], nodes=nodes, uid=self.compose_gen.UID
        )
        self.results = work / "results"
        self.results.mkdir(parents=True, exist_ok=True)
        os.chown(self.results, self.compose_gen.UID, self.compose_gen.UID)
        self.env = {
            **os.environ,
            "FEDPERS_RESULTS": str(self.results),
            "FEDPERS_ISOLATION": isolation,
            "FEDPERS_FLEET_PUBLISH": "127.0.0.1",
        }
        self.cli_home = work / "cli"
        self.cli_home.mkdir(parents=True, exist_ok=True)
        address = f"127.0.0.1:{self.entrypoint.SUPERLINK_PORT}"
        (self.cli_home / "config.toml").write_text(
            self.entrypoint.connection_toml(address, str(self.credentials / "operator" / "ca.crt"))
        )

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``docker-compose -p PROJECT -f FILE ARGS``."""
        return subprocess.run(
            [
                "docker-compose",
                "--no-ansi",
                "-p",
                self.project,
                *(x for f in self.files for x in ("-f", str(f))),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            check=False,
        )

    def container(self, service: str) -> str:
        """The container name compose 1.29 gives ``service``."""
        return f"{self.project}_{service}_1"

    def network(self, name: str) -> str:
        return f"{self.project}_{name}"

    def inspect(self, service: str) -> dict[str, Any]:
        out = docker("inspect", self.container(service), check=True).stdout
        return dict(json.loads(out)[0])

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def up(self, timeout: float = 240) -> None:
        """``up -d`` and wait until every SuperNode reports healthy."""
        result = self.compose("up", "-d", timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"compose up failed:\n{result.stdout}\n{result.stderr}")
        self.wait_healthy([f"supernode-{i}" for i in range(self.nodes)], timeout)

    def use_images(
        self, images: dict[int, str], *, memory: str | None = None, timeout: float = 300
    ) -> None:
        """Recreate SuperNodes on other images, by index (the mixed federation's arm64
        node), keeping their credentials and state volumes, with another memory limit
        where ``memory`` says; ``{}`` goes back to the generated file. The images'
        platform may differ from this machine's."""
        limits = f"    mem_limit: {memory}\n    memswap_limit: {memory}\n" if memory else ""
        override = self.file.with_name("docker-compose.images.yml")
        override.write_text(
            'version: "2.4"\nservices:\n'
            + "".join(
                f"  supernode-{i}:\n    image: {image}\n{limits}" for i, image in images.items()
            )
        )
        changed = [f"supernode-{i}" for i in images] or [
            f"supernode-{i}" for i in range(self.nodes)
        ]
        self.files = [self.file, override] if images else [self.file]
        result = self.compose("up", "-d", "--no-deps", *changed, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"compose up failed:\n{result.stdout}\n{result.stderr}")
        self.wait_healthy(changed, timeout)

    def wait_healthy(self, services: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = {s: self.health(s) for s in services}
            if all(state == "healthy" for state in states.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy in {timeout} s: {states}\n{self.logs()}")
            time.sleep(1)

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", *services).stdout[-6000:]

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """The ``flwr`` CLI on the operator's side."""
        return subprocess.run(
            [str(BIN / "flwr"), *args],
            env=flower_environment(self.cli_home),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=PROJECT,
            check=False,
        )

    def run(
        self, values: dict[str, object], *, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """``flwr run`` of the fedpers app with ``values`` as its run config."""
        config = self.work / f"{values['run-name']}.toml"
        write_run_config(config, values)
        return self.cli(
            "run", str(staged_app(PROJECT, self.work / "app")), self.entrypoint.CONNECTION,
            "--run-config", str(config),
            "--stream", timeout=timeout,
        )  # fmt: skip

    def volume_files(self, volume: str, pattern: str) -> dict[str, bytes]:
        """Files of a named volume matching ``pattern`` (read through a throwaway container)."""
        target = self.work / f"volume-{volume}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        name = f"{self.project}_{volume}"
        docker(
            "run", "--rm", "--network", "none", "-v", f"{name}:/v:ro", "-v", f"{target}:/out",
            "--user", "0", "--entrypoint", "sh", self.compose_gen.IMAGE_DEVICE, "-c",
            f"cp $(find /v -name '{pattern}') /out/ 2>/dev/null; true", check=True,
        )  # fmt: skip
        return {p.name: p.read_bytes() for p in target.iterdir()}

    def close(self) -> None:
        """Remove the project's containers, networks and volumes."""
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "5")


# docker logs -t of a SuperNode: the steps of each message it handles
LOG_LINE = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)\d*Z .*?"
    r"(?:Receiving: (?P<kind>train|evaluate) message|(?P<start>Start `flwr-clientapp`)"
    r"|(?P<sent>Sent successfully))"
)


def exchange_steps(log: str) -> dict[str, dict[str, list[float]]]:
    """Seconds of each train and evaluate message on a device, from its SuperNode's
    timestamped log: ``launch`` from the message's receipt to its ClientApp's launch (the
    SuperExec's poll for tasks), ``clientapp`` from the launch to the reply sent (the
    ClientApp's start, its pull of the message, the computation and the reply's push)."""
    steps: dict[str, dict[str, list[float]]] = {}
    kind, marks = None, {}
    for line in log.splitlines():
        found = LOG_LINE.match(line)
        if found is None:
            continue
        at = datetime.fromisoformat(found["at"][:26]).timestamp()
        if found["kind"]:
            kind, marks = found["kind"], {"received": at}
        elif kind and found["start"] and "received" in marks:
            marks["start"] = at
        elif kind and found["sent"] and "start" in marks:
            step = steps.setdefault(kind, {"launch": [], "clientapp": []})
            step["launch"].append(marks["start"] - marks["received"])
            step["clientapp"].append(at - marks["start"])
            kind, marks = None, {}
    return steps
