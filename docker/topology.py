"""The deployment topology of fedpers, described once.

A SuperLink with TLS and SuperNode authentication, and N SuperNodes, each given its
partition through ``--node-config``, and a Fleet proxy (nginx) that is the devices' only
way in: it forwards the Fleet API (and ``/health``) and refuses the Control and Runtime
APIs, which Flower 1.42 serves on the same port. ``docker-compose.yml`` is generated from
this file (``python docker/topology.py compose > docker/docker-compose.yml``), its services
run ``python docker/topology.py exec ...``, and the multi-node test
(``tests/deployment/test_deployment.py``) starts the same commands as real processes in
network namespaces, so the two cannot drift apart (a test compares them).

    python docker/topology.py compose [--nodes 3]         # print docker-compose.yml
    python docker/topology.py exec superlink              # run the SuperLink
    python docker/topology.py exec supernode <i>          # run SuperNode i
    python docker/topology.py exec proxy                  # run the Fleet proxy
    python docker/topology.py register                    # register the node keys (idempotent)
    python docker/topology.py health superlink|proxy|supernode

Paths and addresses come from the environment (defaults are the containers' paths):
``FEDPERS_CREDENTIALS`` (/credentials), ``FEDPERS_STATE`` (/state),
``FEDPERS_SUPERLINK`` (superlink:9091; the SuperNodes get fleet:9092), ``FEDPERS_NODES``
(3), ``FEDPERS_ISOLATION`` (subprocess), ``FEDPERS_TRUSTED_ENTITIES`` (a SuperNode's
``--trusted-entities`` file; unset by default).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SUPERLINK_PORT = 9091  # Fleet, Control and Runtime APIs share one port in Flower 1.42
PROXY_PORT = 9092  # the Fleet proxy: the only port devices reach
NODE_RUNTIME_PORT = 9094  # each SuperNode's local ClientAppIo port
NODE_HEALTH_PORT = 9095  # each SuperNode's gRPC health server (no TLS, loopback)
NODES = 3
UID = 10001  # the images' non-root user (credentials.py --uid)
CONNECTION = "fedpers"  # name of the SuperLink connection in $FLWR_HOME/config.toml
IMAGE_SERVER = "fedpers-server:1.42"
IMAGE_DEVICE = "fedpers-device:1.42"
BASE = "python:3.11-slim"
RETRY_SECONDS = 10  # a restarted SuperNode whose previous session is still ONLINE waits this
CONNECTION_ERROR = 305  # flower-supernode's exit code when the SuperLink refuses it


def superlink_args(
    credentials: str,
    database: str,
    *,
    host: str = "0.0.0.0",
    port: int = SUPERLINK_PORT,
    isolation: str = "subprocess",
) -> list[str]:
    """The SuperLink command: TLS, SuperNode authentication, no runtime installs."""
    return [
        "flower-superlink",
        "--ssl-ca-certfile", f"{credentials}/ca.crt",
        "--ssl-certfile", f"{credentials}/server.pem",
        "--ssl-keyfile", f"{credentials}/server.key",
        "--enable-supernode-auth",
        "--disable-runtime-dependency-installation",
        "--isolation", isolation,
        "--host", host,
        "--port", str(port),
        "--database", database,
    ]  # fmt: skip


def supernode_args(
    index: int,
    *,
    credentials: str,
    superlink: str,
    num_nodes: int,
    state_dir: str,
    port: int = NODE_RUNTIME_PORT,
    key: str | None = None,
    isolation: str = "subprocess",
    health: str | None = None,
    trusted_entities: str | None = None,
) -> list[str]:
    """SuperNode ``index``: its partition, its key, its state directory.

    ``trusted_entities``: a YAML file of app publishers' ed25519 keys; the node then runs
    only apps signed by one of them. In Flower 1.42 signatures reach a SuperNode only with
    apps fetched from Flower Hub, so such a node refuses every app sent by ``flwr run .``.
    """
    node_config = f"partition-id={index} num-partitions={num_nodes} state-dir='{state_dir}'"
    command = [
        "flower-supernode",
        "--root-certificates", f"{credentials}/ca.crt",
        "--superlink", superlink,
        "--auth-supernode-private-key", key or f"{credentials}/node{index}",
        "--node-config", node_config,
        "--isolation", isolation,
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    if health:
        command += ["--health-server-address", health]
    if trusted_entities:
        command += ["--trusted-entities", trusted_entities]
    return command


def superexec_args(port: int = NODE_RUNTIME_PORT) -> list[str]:
    """What starts the ClientApps of a SuperNode in ``--isolation process``.

    Flower 1.42 has no long-running ClientApp: ``flwr-clientapp`` needs a token per app
    execution, so ``process`` isolation only moves the launcher (``flower-superexec``, which
    ``subprocess`` isolation runs inside the SuperNode) into a process of its own; each
    message still gets a fresh ClientApp process.
    """
    return [
        "flower-superexec", "--runtime-api-address", f"127.0.0.1:{port}", "--insecure",
        "--executor", "subprocess",
    ]  # fmt: skip


def proxy_conf(upstream: str, credentials: str, *, port: int = PROXY_PORT,
               run_dir: str = "/run/nginx-fedpers") -> str:  # fmt: skip
    """nginx: TLS on both sides; the Fleet API and /health pass, everything else is 403."""
    upstream_tls = (
        f"proxy_pass https://{upstream};\n"
        f"            proxy_ssl_trusted_certificate {credentials}/ca.crt;\n"
        "            proxy_ssl_verify on;\n"
        "            proxy_ssl_name superlink;\n"
        "            proxy_ssl_server_name on;\n"
        "            proxy_http_version 1.1;\n"
        "            proxy_request_buffering off;\n"
        "            proxy_buffering off;\n"
        "            proxy_read_timeout 600s;\n"
        "            proxy_send_timeout 600s;"
    )
    return f"""# Generated by docker/topology.py: the devices' only way to the SuperLink.
worker_processes 1;
pid {run_dir}/nginx.pid;
error_log stderr warn;
daemon off;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {run_dir}/body;
    proxy_temp_path {run_dir}/proxy;
    fastcgi_temp_path {run_dir}/fastcgi;
    uwsgi_temp_path {run_dir}/uwsgi;
    scgi_temp_path {run_dir}/scgi;
    client_max_body_size 1g;
    server_tokens off;
    server {{
        listen {port} ssl;
        ssl_certificate {credentials}/proxy.pem;
        ssl_certificate_key {credentials}/proxy.key;
        ssl_protocols TLSv1.2 TLSv1.3;
        location /v1/fleet/ {{
            {upstream_tls}
        }}
        location = /health {{
            {upstream_tls}
        }}
        location / {{
            default_type text/plain;
            return 403 "refused: this port serves the Fleet API only\n";
        }}
    }}
}}
"""


def connection_toml(address: str, root_certificates: str) -> str:
    """``$FLWR_HOME/config.toml`` for the CLI (``flwr run``, ``flwr supernode register``)."""
    return (
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "{address}"\nroot-certificates = "{root_certificates}"\n'
    )


def register_args(public_key: str) -> list[str]:
    """Register a SuperNode's public key with the SuperLink."""
    return ["flwr", "supernode", "register", public_key, CONNECTION]


ALREADY_REGISTERED = "Public key already in use"


def compose(nodes: int = NODES) -> str:
    """docker-compose.yml for a SuperLink, its Fleet proxy and ``nodes`` SuperNodes."""
    environment = [
        "FLWR_TELEMETRY_ENABLED=0",
        "FLWR_DISABLE_UPDATE_CHECK=1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1",
        f"FEDPERS_NODES={nodes}",
        "FEDPERS_ISOLATION=${FEDPERS_ISOLATION:-subprocess}",
    ]
    lines = [
        "# Generated by `python docker/topology.py compose`; edit docker/topology.py instead.",
        "# See the README's Deploy section: credentials, wheelhouse, images (docker build with",
        "# BuildKit, or COMPOSE_DOCKER_CLI_BUILD=1 DOCKER_BUILDKIT=1 docker-compose build), then",
        "#   docker-compose -p fedpers -f docker/docker-compose.yml up -d",
        "# The SuperLink (all its APIs) is published on the operator's 127.0.0.1:9091 only;",
        "# devices reach the Fleet proxy on 9092, which forwards the Fleet API alone.",
        'version: "2.4"',
        "services:",
    ]

    def service(name: str, image: str, build: str, command: list[str], extra: list[str],
                env: list[str] | None = None) -> None:  # fmt: skip
        lines.extend(
            [
                f"  {name}:",
                f"    image: {image}",
                "    build:",
                "      context: ..",
                f"      dockerfile: docker/{build}",
                "      args:",
                f"        BASE: ${{FEDPERS_BASE:-{BASE}}}",
                "    command: [" + ", ".join(f'"{c}"' for c in command) + "]",
                "    environment:",
                *[f'      - "{e}"' for e in environment + (env or [])],
                *extra,
            ]
        )

    health = [
        "    healthcheck:",
        "      interval: 2s",
        "      timeout: 4s",
        "      retries: 30",
    ]
    service(
        "superlink",
        IMAGE_SERVER,
        "Dockerfile.server",
        ["python", "docker/topology.py", "exec", "superlink"],
        [
            "    ports:",
            f'      - "127.0.0.1:{SUPERLINK_PORT}:{SUPERLINK_PORT}"',
            "    networks: [operator]",
            "    volumes:",
            "      - ./credentials/superlink:/credentials:ro",
            "      - superlink-data:/data",
            "      - ${FEDPERS_RESULTS:-../results}:/results",
            *health,
            '      test: ["CMD", "python", "docker/topology.py", "health", "superlink"]',
            "    restart: unless-stopped",
        ],
    )
    service(
        "fleet",
        IMAGE_SERVER,
        "Dockerfile.server",
        ["python", "docker/topology.py", "exec", "proxy"],
        [
            "    ports:",
            f'      - "${{FEDPERS_FLEET_PUBLISH:-0.0.0.0}}:{PROXY_PORT}:{PROXY_PORT}"',
            "    networks: [operator, devices]",
            "    volumes:",
            "      - ./credentials/proxy:/credentials:ro",
            *health,
            '      test: ["CMD", "python", "docker/topology.py", "health", "proxy"]',
            "    depends_on:",
            "      superlink:",
            "        condition: service_healthy",
            "    restart: unless-stopped",
        ],
    )
    service(
        "register",
        IMAGE_SERVER,
        "Dockerfile.server",
        ["python", "docker/topology.py", "register"],
        [
            "    networks: [operator]",
            "    volumes:",
            "      - ./credentials/operator:/credentials:ro",
            "    depends_on:",
            "      superlink:",
            "        condition: service_healthy",
        ],
    )
    for index in range(nodes):
        service(
            f"supernode-{index}",
            IMAGE_DEVICE,
            "Dockerfile.device",
            ["python", "docker/topology.py", "exec", "supernode", str(index)],
            [
                "    networks: [devices]",
                "    volumes:",
                f"      - ./credentials/node{index}:/credentials:ro",
                f"      - supernode-{index}-state:/state",
                *health,
                '      test: ["CMD", "python", "docker/topology.py", "health", "supernode"]',
                "    depends_on:",
                "      register:",
                "        condition: service_completed_successfully",
                "      fleet:",
                "        condition: service_healthy",
                "    restart: unless-stopped",
            ],
            [f"FEDPERS_SUPERLINK=fleet:{PROXY_PORT}"],
        )
    lines += ["networks:", "  operator: {}", "  devices: {}", "volumes:", "  superlink-data: {}"]
    lines.extend(f"  supernode-{index}-state: {{}}" for index in range(nodes))
    return "\n".join(lines) + "\n"


def _environment() -> tuple[str, str, str, int, str]:
    return (
        os.environ.get("FEDPERS_CREDENTIALS", "/credentials"),
        os.environ.get("FEDPERS_STATE", "/state"),
        os.environ.get("FEDPERS_SUPERLINK", f"superlink:{SUPERLINK_PORT}"),
        int(os.environ.get("FEDPERS_NODES", str(NODES))),
        os.environ.get("FEDPERS_ISOLATION", "subprocess"),
    )


def _say(line: str) -> None:
    sys.stderr.write(f"[topology] {line}\n")
    sys.stderr.flush()


def _supervise(commands: list[list[str]]) -> int:
    """Run ``commands`` together; stop all when one ends or on SIGTERM; return its code."""
    children = [subprocess.Popen(command) for command in commands]

    def stop(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while all(child.poll() is None for child in children):
        time.sleep(0.2)
    code = next(child.returncode for child in children if child.returncode is not None)
    for child in children:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
    return code


def run_supernode(index: int) -> int:
    """SuperNode ``index`` (and its ClientApp process in ``process`` isolation).

    A SuperNode restarted after a crash is refused (exit 305) while the SuperLink still
    counts its previous session as ONLINE: Flower 1.42 expires it after two missed 30 s
    heartbeats and offers no setting for that. Rather than a restart loop, wait and retry.
    """
    credentials, state, superlink, nodes, isolation = _environment()
    command = supernode_args(
        index,
        credentials=credentials,
        superlink=superlink,
        num_nodes=nodes,
        state_dir=state,
        isolation=isolation,
        health=f"127.0.0.1:{NODE_HEALTH_PORT}",
        trusted_entities=os.environ.get("FEDPERS_TRUSTED_ENTITIES") or None,
    )
    started = time.monotonic()
    while True:
        commands = [command] + ([superexec_args()] if isolation == "process" else [])
        code = _supervise(commands)
        if code != CONNECTION_ERROR or time.monotonic() - started > 300:
            return code
        _say(
            f"node{index}: the SuperLink refused the connection (its previous session may "
            f"still count as ONLINE until its heartbeat expires); retrying in {RETRY_SECONDS} s"
        )
        time.sleep(RETRY_SECONDS)


def register(credentials: str, superlink: str, nodes: int) -> int:
    """Register every node's public key; a key registered before counts as done."""
    home = Path(os.environ.get("FLWR_HOME", str(Path.home() / ".flwr")))
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(connection_toml(superlink, f"{credentials}/ca.crt"))
    for index in range(nodes):
        public = f"{credentials}/nodes/node{index}.pub"
        result = subprocess.run(register_args(public), capture_output=True, text=True)
        output = result.stdout + result.stderr
        if result.returncode == 0:
            _say(f"node{index}: registered")
        elif ALREADY_REGISTERED in output:
            _say(f"node{index}: already registered")
        else:
            _say(f"node{index}: registration failed:\n{output[-2000:]}")
            return result.returncode or 1
    return 0


def health(role: str, credentials: str) -> bool:
    """Is ``role`` in this container serving (the health check of its service)?"""
    if role == "supernode":
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{NODE_HEALTH_PORT}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    import ssl
    import urllib.request

    port = SUPERLINK_PORT if role == "superlink" else PROXY_PORT
    context = ssl.create_default_context(cafile=f"{credentials}/ca.crt")
    context.check_hostname = False  # the certificate names superlink/fleet and localhost
    with urllib.request.urlopen(
        f"https://localhost:{port}/health", context=context, timeout=3
    ) as reply:
        return bool(reply.status == 200)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    compose_parser = commands.add_parser("compose")
    compose_parser.add_argument("--nodes", type=int, default=NODES)
    run_parser = commands.add_parser("exec")
    run_parser.add_argument("role", choices=["superlink", "supernode", "proxy"])
    run_parser.add_argument("index", type=int, nargs="?", default=0)
    commands.add_parser("register")
    health_parser = commands.add_parser("health")
    health_parser.add_argument("role", choices=["superlink", "supernode", "proxy"])
    args = parser.parse_args(argv)
    credentials, _state, superlink, nodes, _isolation = _environment()
    if args.command == "compose":
        sys.stdout.write(compose(args.nodes))
    elif args.command == "exec" and args.role == "superlink":
        command = superlink_args(credentials, "/data/state.db")  # ServerApp: subprocess
        os.execvp(command[0], command)
    elif args.command == "exec" and args.role == "supernode":
        sys.exit(run_supernode(args.index))
    elif args.command == "exec":
        upstream = os.environ.get("FEDPERS_UPSTREAM", f"superlink:{SUPERLINK_PORT}")
        run_dir = Path("/run/nginx-fedpers")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "nginx.conf").write_text(proxy_conf(upstream, credentials, run_dir=str(run_dir)))
        os.execvp("nginx", ["nginx", "-c", str(run_dir / "nginx.conf")])
    elif args.command == "register":
        sys.exit(register(credentials, superlink, nodes))
    else:
        try:
            sys.exit(0 if health(args.role, credentials) else 1)
        except Exception as error:  # any failure is "unhealthy"
            _say(f"{args.role} unhealthy: {error}")
            sys.exit(1)


if __name__ == "__main__":
    main()
