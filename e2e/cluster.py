"""A real Kubernetes control plane as local processes: etcd, kube-apiserver, kube-scheduler and
kube-controller-manager (a few controllers).

Command line::

    python -m e2e.cluster up --dir DIR [--second-scheduler] [--kube-version V] [--no-vramguard]
    python -m e2e.cluster down --dir DIR

Library::

    with Cluster.up(tmp_path / "cluster") as cluster:
        core = cluster.core_v1()
        ...

``up`` returns once every component is ready and writes ``DIR/kubeconfig`` (admin), logs to
``DIR/logs/`` and pid files to ``DIR/pids/``; ``down`` stops every process group it started.
All ports are picked free on 127.0.0.1, so several clusters can run side by side.

No kubelet or container runtime runs: Nodes are API objects (see ``e2e.gpu_nodes``), pods are
scheduled and bound but never start. kube-controller-manager runs only the controllers in
``CONTROLLERS`` (DRA claims, garbage collection, Deployments); the admission plugins that need the
others (``ServiceAccount``, ``TaintNodesByCondition``) are disabled.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import secrets
import shutil
import signal
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from e2e import build, containers, gpu_nodes, kube, services
from e2e.certs import CertificateAuthority, KeyPair, service_account_keys
from e2e.procs import (
    ManagedProcess,
    StartupError,
    free_ports,
    group_members,
    http_status,
    read_records,
    wait_until,
    write_records,
)
from e2e.service_proxy import Backend, ServiceProxy

VramguardMode = Literal["auto", "on", "off"]

ADMIN_USER = "kubernetes-admin"
SCHEDULER_USER = "system:kube-scheduler"
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"
CONTROLLERS = (
    # DRA: creates claims from ResourceClaimTemplates, sets pod.status.resourceClaimStatuses, and
    # deallocates a claim once no pod it is reserved for exists any more.
    "resourceclaim-controller",
    # Deletes the claims the scheduler creates for DRA extended resources with their pod.
    "garbage-collector-controller",
    # Deployments, as the tests scale them.
    "deployment-controller",
    "replicaset-controller",
)
"""The kube-controller-manager controllers the harness runs; nothing else (no node lifecycle, which
would taint the kubelet-less Nodes not-ready; no ServiceAccount tokens, which nothing here uses)."""
POD_NETWORK_CONTROLLERS = (
    # Pods that talk to the API server: each namespace's default ServiceAccount and its
    # kube-root-ca.crt, Services' endpoints (webhooks behind a Service), DaemonSets.
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "endpointslice-controller",
    "daemonset-controller",
    "namespace-controller",
)
"""What a cluster with ``pod_network`` runs on top of :data:`CONTROLLERS`."""

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
STATE_FILE = "cluster.json"
PROCESSES_FILE = "processes.json"
PORT_ATTEMPTS = 3


def _log(message: str) -> None:
    print(f"e2e.cluster: {message}", file=sys.stderr, flush=True)


def host_address() -> str:
    """This machine's address on its default route (where pods on real nodes reach the API server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
        return str(probe.getsockname()[0])


@dataclass
class ClusterConfig:
    """How to start a cluster."""

    directory: Path
    kube_version: str | None = None
    """Kubernetes version or minor (default: ``$KUBE_VERSION``, else the newest 1.36.x)."""
    second_scheduler: bool = False
    """Run the extender behind a second scheduler named ``vramguard`` instead of the default one."""
    vramguard: VramguardMode = "auto"
    """``auto``: start each vramguard service whose ``--help`` works; ``on``: require both."""
    policy: Path | None = None
    """Policy file passed to the vramguard services as ``--policy``."""
    vramguard_command: Sequence[str] | None = None
    """The command that provides ``extender`` and ``webhook`` (default: ``vramguard``)."""
    service_args: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Extra command-line arguments per vramguard service, e.g. ``{"extender": ["--max-watch-event-bytes", "1Mi"]}``."""
    manifests: Path = services.MANIFESTS
    image: str | None = None
    """Run the extender and webhook as containers of this image (see ``e2e.containers``), not processes."""
    detach: bool = False
    """Let the processes outlive this Python process (the command line does this)."""
    timeout: float = 120.0
    """Seconds each component may take to become ready."""
    extender_replicas: int = 1
    """Extender processes electing a leader; more than one sit behind a :class:`ServiceProxy` on
    the extender's port, as replicas behind a Service (processes ``vramguard-extender-<i>``)."""
    extender_verbs: Sequence[str] | None = None
    """The only extender verbs the schedulers are configured to call (``None``: as shipped); see
    :func:`e2e.services.localize_scheduler_config`."""
    pod_network: bool = False
    """Pods on real nodes reach the API server and Services as in a cluster: the API server listens
    on the machine's address (its ``kubernetes`` Service points there), ServiceAccounts are admitted
    and their tokens mounted, Services get endpoints; the real nodes run kube-proxy
    (``e2e.real_nodes``)."""


@dataclass
class ClusterState:
    """What a running cluster looks like; persisted as ``DIR/cluster.json``."""

    directory: str
    version: str
    server: str
    etcd_url: str
    admin_token: str
    second_scheduler: bool
    scheduler_ports: dict[str, int] = field(default_factory=dict)
    vramguard: dict[str, str] = field(default_factory=dict)
    """Service name -> https URL of each vramguard service started."""
    vramguard_ops: dict[str, str] = field(default_factory=dict)
    """Service name -> http URL of the probes and metrics of a service that serves them apart."""
    up_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form."""
        return dict(self.__dict__)


def kubeconfig_document(*, server: str, ca_b64: str, user: str, token: str, name: str) -> dict[str, Any]:
    """A kubeconfig with one cluster, one token user and one current context."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority-data": ca_b64}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": user}}],
        "current-context": name,
        "preferences": {},
    }


def token_auth_line(token: str, user: str, uid: str, groups: Sequence[str] = ()) -> str:
    """One line of a --token-auth-file: ``token,user,uid,"group1,group2"``."""
    line = f"{token},{user},{uid}"
    if groups:
        line += ',"' + ",".join(groups) + '"'
    return line


class Cluster:
    """A local control plane; see the module docstring."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.directory = config.directory.resolve()
        self.processes: list[ManagedProcess] = []
        self._extender_service: ServiceProxy | None = None
        self.state: ClusterState | None = None
        self._ca: CertificateAuthority | None = None
        self._atexit_registered = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def up(
        cls,
        directory: Path,
        *,
        kube_version: str | None = None,
        second_scheduler: bool = False,
        vramguard: VramguardMode = "auto",
        policy: Path | None = None,
        vramguard_command: Sequence[str] | None = None,
        service_args: Mapping[str, Sequence[str]] | None = None,
        image: str | None = None,
        detach: bool = False,
        timeout: float = 120.0,
        extender_replicas: int = 1,
        extender_verbs: Sequence[str] | None = None,
        pod_network: bool = False,
    ) -> Cluster:
        """Build (if needed) and start a cluster in ``directory``; return once it is ready."""
        cluster = cls(
            ClusterConfig(
                directory=directory,
                kube_version=kube_version,
                second_scheduler=second_scheduler,
                vramguard=vramguard,
                policy=policy,
                vramguard_command=vramguard_command,
                service_args=dict(service_args or {}),
                image=image,
                detach=detach,
                timeout=timeout,
                extender_replicas=extender_replicas,
                extender_verbs=extender_verbs,
                pod_network=pod_network,
            )
        )
        cluster.start()
        return cluster

    @classmethod
    def attach(cls, directory: Path | str) -> Cluster:
        """A handle on a cluster started earlier (possibly by another process) in ``directory``."""
        cluster = cls(ClusterConfig(directory=Path(directory), detach=True))
        state_path = cluster.directory / STATE_FILE
        if state_path.is_file():
            cluster.state = ClusterState(**json.loads(state_path.read_text()))
        cluster.processes = [ManagedProcess(record) for record in read_records(cluster.directory / PROCESSES_FILE)]
        return cluster

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ------------------------------------------------------------------ paths and accessors

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (user ``kubernetes-admin`` in group ``system:masters``)."""
        return self.directory / "kubeconfig"

    @property
    def logs(self) -> Path:
        """Directory holding one log file per component."""
        return self.directory / "logs"

    @property
    def pki(self) -> Path:
        """Certificates, keys, the token file and the component kubeconfigs."""
        return self.directory / "pki"

    @property
    def version(self) -> str:
        """The Kubernetes version the cluster runs."""
        return self._require_state().version

    @property
    def server(self) -> str:
        """The API server URL (``https://127.0.0.1:<port>``)."""
        return self._require_state().server

    @property
    def ca(self) -> CertificateAuthority:
        """The harness CA: it signs the API server's and the vramguard services' certificates."""
        if self._ca is None:
            self._ca = CertificateAuthority.load(self.pki / "ca.crt", self.pki / "ca.key")
        return self._ca

    def _require_state(self) -> ClusterState:
        if self.state is None:
            raise RuntimeError(f"no cluster state in {self.directory}; is it up?")
        return self.state

    def pgids(self) -> list[int]:
        """Process group ids of every component started (each is a session leader)."""
        return [proc.record.pid for proc in self.processes]

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` authenticated as the admin."""
        return kube.api_client(self.kubeconfig)

    def core_v1(self) -> Any:
        """A ``kubernetes.client.CoreV1Api`` authenticated as the admin."""
        return kube.core_v1(self.api_client())

    def ssl_context(self) -> ssl.SSLContext:
        """An SSL context that trusts the harness CA."""
        return ssl.create_default_context(cadata=self.ca.cert_pem.decode())

    def request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, content_type: str = "application/json"
    ) -> Any:
        """A JSON request to the API server as the admin (``content_type``: a PATCH's patch type);
        raises urllib's HTTPError on >= 400."""
        state = self._require_state()
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(state.server + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {state.admin_token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        with urllib.request.urlopen(request, timeout=30, context=self.ssl_context()) as response:
            return json.loads(response.read() or b"null")

    def create_nodes(self, path: Path) -> list[str]:
        """Create the Nodes of a manifest file (other kinds are ignored), Ready, with the
        ``allocatable`` each says; their names. Nothing runs on them: no kubelet, no device."""
        documents = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if isinstance(d, Mapping)]
        nodes = [d for d in documents if d.get("kind") == "Node"]
        if not nodes:
            raise ValueError("the file has no Node")
        names = []
        for node in nodes:
            metadata = node.get("metadata") or {}
            name = str(metadata.get("name", ""))
            manifest = {"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": name, "labels": dict(metadata.get("labels") or {}),
                                     "annotations": dict(metadata.get("annotations") or {})},
                        "spec": dict(node.get("spec") or {})}
            created = self.request("POST", "/api/v1/nodes", manifest)
            status = gpu_nodes.status_as_written(node)
            self.request("PUT", f"/api/v1/nodes/{name}/status", {**created, "status": status})
            names.append(name)
        return names

    def create(self, obj: Mapping[str, Any]) -> None:
        """Create an object the harness knows the path of; an existing one is left alone."""
        try:
            self.request("POST", services.object_path(obj), obj)
        except urllib.error.HTTPError as error:
            if error.code != 409:
                detail = error.read().decode(errors="replace")
                raise RuntimeError(f"creating {obj['kind']} failed: {error.code} {detail}") from error

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Start every component and wait for each to be ready (stopping all on failure)."""
        if (self.directory / PROCESSES_FILE).is_file():
            previous = Cluster.attach(self.directory)
            if any(proc.record.running() for proc in previous.processes):
                raise RuntimeError(f"a cluster is already running in {self.directory}; run down first")
        started = time.monotonic()
        binaries = build.ensure_built(self.config.kube_version)
        if not self.config.detach and not self._atexit_registered:
            atexit.register(self.down)
            self._atexit_registered = True
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._prepare_directory()
            try:
                self._start(binaries, started)
                return
            except StartupError as error:
                self.down()
                # Ports are picked free but only bound later; another process may take one first.
                if "address already in use" not in str(error) or attempt == PORT_ATTEMPTS:
                    raise
                _log(f"a port was taken meanwhile; starting again with new ports ({error.args[0][:80]})")
            except BaseException:
                self.down()
                raise

    def _prepare_directory(self) -> None:
        for stale in ("etcd", "pki", "config", "pids", "logs", "containers"):
            shutil.rmtree(self.directory / stale, ignore_errors=True)
        for sub in ("pki", "config", "pids", "logs"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        for stale_file in (STATE_FILE, PROCESSES_FILE):
            (self.directory / stale_file).unlink(missing_ok=True)

    def _spawn(self, name: str, argv: Sequence[str]) -> ManagedProcess:
        proc = ManagedProcess.start(
            name,
            argv,
            log_path=self.logs / f"{name}.log",
            pid_dir=self.directory / "pids",
            cwd=self.directory,
            die_with_parent=not self.config.detach,
        )
        self.processes.append(proc)
        write_records(self.directory / PROCESSES_FILE, self.processes)
        return proc

    def _start(self, binaries: build.Binaries, started: float) -> None:
        cfg = self.config
        wanted = self._vramguard_services()
        (
            etcd_port,
            peer_port,
            api_port,
            sched_port,
            second_port,
            extender_port,
            extender_ops_port,
            webhook_port,
            controller_manager_port,
        ) = free_ports(9)
        server = f"https://127.0.0.1:{api_port}"
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        host = host_address() if cfg.pod_network else None

        # Credentials: one CA for everything, static tokens for every client.
        ca = CertificateAuthority.create("vramguard-e2e-ca")
        self._ca = ca
        ca.write(self.pki / "ca.crt", self.pki / "ca.key")
        ca.issue(
            "kube-apiserver",
            ip_addresses=["127.0.0.1", str(next(ipaddress.ip_network(SERVICE_CLUSTER_IP_RANGE).hosts())),
                          *([host] if host else [])],
            dns_names=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"],
        ).write(self.pki / "apiserver.crt", self.pki / "apiserver.key")
        service_account_keys(self.pki / "sa.key", self.pki / "sa.pub")
        # A separate CA for the aggregation layer's request-header authentication, as kubeadm
        # sets it up: the schedulers' delegated authentication reads it from the
        # extension-apiserver-authentication ConfigMap and complains when it is missing.
        front_proxy_ca = CertificateAuthority.create("vramguard-e2e-front-proxy-ca")
        front_proxy_ca.write(self.pki / "front-proxy-ca.crt", self.pki / "front-proxy-ca.key")
        front_proxy_ca.issue("front-proxy-client", server=False, client=True).write(
            self.pki / "front-proxy-client.crt", self.pki / "front-proxy-client.key"
        )
        # The API server's client certificate for the kubelets of real nodes (logs, exec).
        ca.issue("kube-apiserver-kubelet-client", organizations=["system:masters"], server=False, client=True).write(
            self.pki / "apiserver-kubelet-client.crt", self.pki / "apiserver-kubelet-client.key"
        )
        # kube-scheduler's client certificate for the extender's mutual TLS (tlsConfig.certFile).
        ca.issue("kube-scheduler", server=False, client=True).write(*self.scheduler_client_cert)
        tokens = {name: secrets.token_hex(16) for name in ("admin", "scheduler", "controller-manager")}
        identities = {name: services.service_identity(name, cfg.manifests) for name in wanted}
        lines = [
            token_auth_line(tokens["admin"], ADMIN_USER, "admin", ["system:masters"]),
            token_auth_line(tokens["scheduler"], SCHEDULER_USER, "kube-scheduler"),
            # A test control plane: the controllers run under one identity with every right,
            # instead of one ServiceAccount per controller (which needs the token controller).
            token_auth_line(
                tokens["controller-manager"], CONTROLLER_MANAGER_USER, "kube-controller-manager", ["system:masters"]
            ),
        ]
        for name, identity in identities.items():
            tokens[name] = secrets.token_hex(16)
            lines.append(token_auth_line(tokens[name], identity.username, name, identity.groups))
        token_file = self.pki / "tokens.csv"
        token_file.touch(mode=0o600)
        token_file.write_text("\n".join(lines) + "\n")

        def write_kubeconfig(path: Path, user: str, token: str) -> Path:
            document = kubeconfig_document(
                server=server, ca_b64=ca.cert_b64, user=user, token=token, name="vramguard-e2e"
            )
            path.touch(mode=0o600)
            path.write_text(yaml.safe_dump(document, sort_keys=False))
            return path

        write_kubeconfig(self.kubeconfig, ADMIN_USER, tokens["admin"])
        scheduler_kubeconfig = write_kubeconfig(self.pki / "scheduler.kubeconfig", SCHEDULER_USER, tokens["scheduler"])
        self.state = ClusterState(
            directory=str(self.directory),
            version=binaries.version,
            server=server,
            etcd_url=etcd_url,
            admin_token=tokens["admin"],
            second_scheduler=cfg.second_scheduler,
        )

        # etcd
        etcd = self._spawn(
            "etcd",
            [
                str(binaries.etcd),
                "--name=e2e",
                f"--data-dir={self.directory / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=e2e=http://127.0.0.1:{peer_port}",
                "--initial-cluster-state=new",
                # Test data: durability is not worth the fsync latency.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        waited = wait_until(
            "etcd /health",
            lambda: http_status(f"{etcd_url}/health") == 200,
            timeout=cfg.timeout,
            process=etcd,
        )
        _log(f"etcd ready on {etcd_url} ({waited:.1f}s)")

        # kube-apiserver
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(binaries.kube_apiserver),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={'0.0.0.0' if host else '127.0.0.1'}",
                f"--advertise-address={host or '127.0.0.1'}",
                f"--secure-port={api_port}",
                f"--cert-dir={self.pki}",
                f"--tls-cert-file={self.pki / 'apiserver.crt'}",
                f"--tls-private-key-file={self.pki / 'apiserver.key'}",
                f"--client-ca-file={self.pki / 'ca.crt'}",
                f"--token-auth-file={token_file}",
                f"--requestheader-client-ca-file={self.pki / 'front-proxy-ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={self.pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={self.pki / 'front-proxy-client.key'}",
                "--authorization-mode=Node,RBAC",
                f"--kubelet-client-certificate={self.pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={self.pki / 'apiserver-kubelet-client.key'}",
                # Real nodes are reached at their address; their host names resolve nowhere.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                # kube-controller-manager runs only the controllers in CONTROLLERS: nothing would
                # create ServiceAccounts (without pod_network) or lift the not-ready taint
                # TaintNodesByCondition sets.
                "--disable-admission-plugins="
                + ("TaintNodesByCondition" if host else "ServiceAccount,TaintNodesByCondition"),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.pki / 'sa.pub'}",
                f"--service-account-signing-key-file={self.pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                # 127.0.0.1 is not a valid endpoint address for the kubernetes Service.
                *([] if host else ["--endpoint-reconciler-type=none"]),
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
        )
        context = ssl.create_default_context(cadata=ca.cert_pem.decode())
        waited = wait_until(
            "kube-apiserver /readyz",
            lambda: http_status(f"{server}/readyz", context=context, token=tokens["admin"]) == 200,
            timeout=cfg.timeout,
            process=apiserver,
        )
        _log(f"kube-apiserver {binaries.version} ready on {server} ({waited:.1f}s)")
        self._start_controller_manager(
            binaries,
            controller_manager_port,
            write_kubeconfig(
                self.pki / "controller-manager.kubeconfig", CONTROLLER_MANAGER_USER, tokens["controller-manager"]
            ),
        )

        # vramguard services (before the schedulers, which call the extender)
        urls: dict[str, str] = {}
        if wanted:
            autoscaler = _scale_up_autoscaler(cfg.policy)
            for obj in services.rbac_objects(list(identities.values()), cfg.manifests, autoscaler=autoscaler):
                self.create(obj)
            ports = {"extender": extender_port, "webhook": webhook_port}
            ops_ports = {"extender": extender_ops_port}
            for name in wanted:
                kubeconfig = write_kubeconfig(self.pki / f"{name}.kubeconfig", identities[name].username, tokens[name])
                if name == "extender" and cfg.extender_replicas > 1:
                    urls[name] = self._start_extender_replicas(ports[name], kubeconfig)
                    continue
                urls[name] = self._start_vramguard_service(name, ports[name], kubeconfig, ops_ports.get(name))
            if "webhook" in urls:
                webhook = services.localize_webhook_configuration(
                    services.webhook_configuration(cfg.manifests), webhook_url=urls["webhook"], ca_b64=ca.cert_b64
                )
                self.create(webhook)
                _log(f"registered ValidatingWebhookConfiguration {webhook['metadata']['name']}")
                mutating = services.localize_webhook_configuration(
                    services.mutating_webhook_configuration(cfg.manifests),
                    webhook_url=urls["webhook"],
                    ca_b64=ca.cert_b64,
                )
                self.create(mutating)
                _log(f"registered MutatingWebhookConfiguration {mutating['metadata']['name']}")
                for policy in services.admission_policies(cfg.manifests, routing=cfg.second_scheduler):
                    self.create(policy)
        self.state.vramguard.update(urls)  # the extender replicas (if any) are there already

        # kube-scheduler (and the second scheduler)
        extender_url = urls.get("extender")
        if cfg.second_scheduler:
            second = services.load_yaml(cfg.manifests / "scheduler" / services.SECOND_SCHEDULER_CONFIG.name)
            schedulers = {
                "kube-scheduler": (services.plain_scheduler_config(second), sched_port, None),
                "vramguard-scheduler": (second, second_port, extender_url),
            }
        else:
            schedulers = {
                "kube-scheduler": (
                    services.load_yaml(cfg.manifests / "scheduler" / services.DEFAULT_SCHEDULER_CONFIG.name),
                    sched_port,
                    extender_url,
                )
            }
        for scheduler, (template, port, url) in schedulers.items():
            local = services.localize_scheduler_config(
                template,
                kubeconfig=scheduler_kubeconfig,
                extender_url=url,
                ca_b64=ca.cert_b64,
                client_cert=self.scheduler_client_cert,
                verbs=cfg.extender_verbs,
            )
            config_path = self.directory / "config" / f"{scheduler}.yaml"
            config_path.write_text(yaml.safe_dump(local, sort_keys=False))
            queue = services.scheduler_queue_args(cfg.manifests) if url is not None else []
            self._start_scheduler(binaries, scheduler, config_path, port, scheduler_kubeconfig, queue)
            self.state.scheduler_ports[scheduler] = port

        self.state.up_seconds = round(time.monotonic() - started, 1)
        (self.directory / STATE_FILE).write_text(json.dumps(self.state.to_json(), indent=2) + "\n")
        _log(f"cluster {binaries.version} up in {self.state.up_seconds:.1f}s ({self.directory})")

    def _vramguard_services(self) -> list[services.ServiceName]:
        mode = self.config.vramguard
        if mode == "off":
            return []
        command = self._command()
        available = [name for name in services.SERVICES if command and services.service_available(name, command)]
        if mode == "on" and len(available) != len(services.SERVICES):
            missing = sorted(set(services.SERVICES) - set(available))
            raise StartupError(f"vramguard {', '.join(missing)} not available (`vramguard <service> --help` failed)")
        if mode == "auto":
            skipped = [name for name in services.SERVICES if name not in available]
            if skipped:
                _log(f"running without vramguard {' and '.join(skipped)} (`vramguard <service> --help` failed)")
        return available

    def _command(self) -> list[str] | None:
        if self.config.image:
            return containers.help_command(self.config.image)
        if self.config.vramguard_command:
            return list(self.config.vramguard_command)
        return services.vramguard_command()

    @property
    def scheduler_client_cert(self) -> tuple[Path, Path]:
        """kube-scheduler's client certificate and key for the extender (signed by the harness CA)."""
        return self.pki / "scheduler-client.crt", self.pki / "scheduler-client.key"

    def client_ssl_context(self) -> ssl.SSLContext:
        """An SSL context that trusts the harness CA and presents kube-scheduler's client certificate."""
        context = self.ssl_context()
        context.load_cert_chain(*self.scheduler_client_cert)
        return context

    def ops_url(self, service: services.ServiceName) -> str:
        """Where ``service`` answers ``/healthz``, ``/readyz`` and ``/metrics``."""
        state = self._require_state()
        url = state.vramguard_ops.get(service) or state.vramguard.get(service)
        if url is None:
            raise RuntimeError(f"vramguard {service} is not running in this cluster")
        return url

    def _start_extender_replicas(self, port: int, kubeconfig: Path) -> str:
        """``extender_replicas`` extenders on ports of their own, behind a Service proxy on ``port``.

        Each one's probes are at ``state.vramguard_ops["extender-<i>"]``. Returns once one of them
        (the leader) is ready; the others are live standbys, never ready while it leads."""
        backends = []
        for replica in range(self.config.extender_replicas):
            backend_port, ops_port = free_ports(2)
            process = f"vramguard-extender-{replica}"
            url = self._start_vramguard_service(
                "extender", backend_port, kubeconfig, ops_port, process=process, ready=False
            )
            self._require_state().vramguard[f"extender-{replica}"] = url
            ops = self._require_state().vramguard_ops.pop("extender")
            self._require_state().vramguard_ops[f"extender-{replica}"] = ops
            backends.append(Backend(backend_port, f"{ops}/readyz"))
        self._extender_service = ServiceProxy(port, backends)
        self._extender_service.start()
        wait_until(
            "an extender replica /readyz",
            lambda: any(http_status(backend.ready_url) == 200 for backend in backends),
            timeout=self.config.timeout,
        )
        return f"https://127.0.0.1:{port}"

    def _start_vramguard_service(
        self,
        name: services.ServiceName,
        port: int,
        kubeconfig: Path,
        ops_port: int | None = None,
        *,
        process: str | None = None,
        ready: bool = True,
    ) -> str:
        """Start one vramguard service; wait for ``/readyz`` (``ready``) or only ``/healthz`` (a standby)."""
        command = self._command()
        assert command, "checked by _vramguard_services"
        pair: KeyPair = self.ca.issue_localhost_server(f"vramguard-{name}")
        cert, key = self.pki / f"{name}.crt", self.pki / f"{name}.key"
        pair.write(cert, key)
        policy = self.config.policy or self._wired_policy()
        if self.config.image:
            argv = containers.run_argv(
                self.config.image,
                name,
                name=containers.container_name(name, self.directory),
                state_dir=self.directory / "containers" / name,
                port=port,
                ops_port=ops_port,
                tls=(cert, key),
                ca_cert=self.pki / "ca.crt",
                kubeconfig=kubeconfig,
                policy=policy,
                root=self.config.manifests,
            )
        else:
            argv = services.service_argv(
                command,
                name,
                port=port,
                tls_cert=cert,
                tls_key=key,
                kubeconfig=kubeconfig,
                policy=policy,
                # The extender's verbs bind pods: only kube-scheduler's client certificate gets an answer.
                client_ca=self.pki / "ca.crt" if name == "extender" else None,
                ops_port=ops_port,
            )
        argv += self.config.service_args.get(name, ())
        proc = self._spawn(process or f"vramguard-{name}", argv)
        url = f"https://127.0.0.1:{port}"
        ready_url = url
        if ops_port is not None:
            ready_url = self._require_state().vramguard_ops[name] = f"http://127.0.0.1:{ops_port}"
        if not ready:
            waited = wait_until(
                f"vramguard {name} /healthz",
                lambda: http_status(f"{ready_url}/healthz") == 200,
                timeout=self.config.timeout,
                process=proc,
            )
            _log(f"vramguard {name} live on {url} ({waited:.1f}s)")
            return url
        waited = self._wait_ready(name, ready_url, proc)
        _log(f"vramguard {name} ready on {url} ({waited:.1f}s)")
        return url

    def _wired_policy(self) -> Path:
        """The shipped policy naming the scheduler profile this cluster wires the extender into
        (bind refuses the pods of any other scheduler)."""
        policy = yaml.safe_load((Path(__file__).parent.parent / "vramguard" / "default_policy.yaml").read_text())
        policy["schedulers"] = [services.SECOND_SCHEDULER_NAME if self.config.second_scheduler else "default-scheduler"]
        path = self.directory / "config" / "policy.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(policy, sort_keys=False))
        return path

    def _wait_ready(self, service: services.ServiceName, url: str, proc: ManagedProcess) -> float:
        """Wait until a vramguard service answers ``url/readyz`` with 200; return the seconds waited."""
        context = self.ssl_context() if url.startswith("https:") else None
        return wait_until(
            f"vramguard {service} /readyz",
            lambda: http_status(f"{url}/readyz", context=context) == 200,
            timeout=self.config.timeout,
            process=proc,
        )

    def restart_vramguard(
        self,
        service: services.ServiceName,
        sig: signal.Signals = signal.SIGTERM,
        *,
        grace: float = 15.0,
        replica: int | None = None,
    ) -> None:
        """Stop a running vramguard service with ``sig`` and start it again with the same command line.

        The port, certificate and kubeconfig stay the same, so the schedulers and the webhook
        configuration keep pointing at it. Returns once the new process answers ``/readyz``, or
        ``/healthz`` for one of several extender ``replica``s (a standby is never ready).
        SIGKILL simulates a crash; SIGTERM a rolling restart. Whatever is left after ``grace``
        seconds is killed.
        """
        key = service if replica is None else f"{service}-{replica}"
        name = f"vramguard-{key}"
        state = self._require_state()
        url = state.vramguard.get(key)
        index = next((i for i, proc in enumerate(self.processes) if proc.name == name), None)
        if url is None or index is None:
            raise RuntimeError(f"vramguard {service} is not running in this cluster")
        proc = self._replace_process(index, sig, grace)
        _log(f"vramguard {service} stopped with {sig.name}; restarted")
        if replica is not None:
            ops = state.vramguard_ops[key]
            waited = wait_until(
                f"vramguard {key} /healthz",
                lambda: http_status(f"{ops}/healthz") == 200,
                timeout=self.config.timeout,
                process=proc,
            )
            _log(f"vramguard {key} live again on {url} ({waited:.1f}s)")
            return
        waited = self._wait_ready(service, self.ops_url(service), proc)
        _log(f"vramguard {service} ready again on {url} ({waited:.1f}s)")

    def roll_extender(self, *, grace: float = 30.0) -> list[int]:
        """Replace every extender replica as a Deployment's RollingUpdate with ``maxUnavailable: 100%``
        does: start as many new replicas (new ports, behind the same Service proxy), then SIGTERM the
        old ones (each drains for its ``--drain-delay`` and releases the Lease) and drop them from the
        proxy once they are gone. Returns the new replicas' indexes; they are live, one becomes ready."""
        state = self._require_state()
        proxy = self._extender_service
        if proxy is None:
            raise RuntimeError("the extender does not run as replicas behind a Service in this cluster")
        old = {key: state.vramguard_ops[key] for key in state.vramguard_ops if key.startswith("extender-")}
        first = 1 + max(int(key.rpartition("-")[2]) for key in old)
        new = list(range(first, first + len(old)))
        for replica in new:
            backend_port, ops_port = free_ports(2)
            url = self._start_vramguard_service("extender", backend_port, self.pki / "extender.kubeconfig", ops_port,
                                                process=f"vramguard-extender-{replica}", ready=False)
            state.vramguard[f"extender-{replica}"] = url
            state.vramguard_ops[f"extender-{replica}"] = ops = state.vramguard_ops.pop("extender")
            proxy.backends.append(Backend(backend_port, f"{ops}/readyz"))
        leaving = [proc for proc in self.processes if proc.name in {f"vramguard-{key}" for key in old}]
        for proc in leaving:
            proc.send(signal.SIGTERM)
        for proc in leaving:
            if not proc.wait_gone(grace):
                proc.stop(timeout=0)
        proxy.backends[:] = [b for b in proxy.backends if b.ready_url not in {f"{ops}/readyz" for ops in old.values()}]
        self.processes = [proc for proc in self.processes if proc not in leaving]
        for key in old:
            state.vramguard.pop(key, None)
            state.vramguard_ops.pop(key, None)
        write_records(self.directory / PROCESSES_FILE, self.processes)
        _log(f"extender replicas {sorted(old)} replaced by {new}")
        return new

    def _replace_process(self, index: int, sig: signal.Signals, grace: float) -> ManagedProcess:
        """Stop ``self.processes[index]`` with ``sig`` (killing what is left after ``grace`` seconds)
        and start the same command line again in its place, with the same log and pid file."""
        old = self.processes[index]
        old.send(sig)
        if not old.wait_gone(grace):
            old.stop(timeout=0)
        proc = ManagedProcess.start(
            old.name,
            old.record.argv,
            log_path=Path(old.record.log),
            pid_dir=self.directory / "pids",
            cwd=self.directory,
            die_with_parent=not self.config.detach,
        )
        self.processes[index] = proc
        write_records(self.directory / PROCESSES_FILE, self.processes)
        return proc

    def restart_apiserver(self, *, grace: float = 10.0) -> float:
        """Stop kube-apiserver with SIGTERM and start it again: same etcd, flags, port and certificates.

        Returns the seconds from the signal until the new process answers ``/readyz``. Clients keep
        their URLs and tokens; their watches break and must be re-established, as on an upgrade.
        kube-apiserver stops listening at once but may take 30 s to exit; what is left after
        ``grace`` seconds is killed, as the kubelet does after a pod's grace period.
        """
        state = self._require_state()
        index = next((i for i, proc in enumerate(self.processes) if proc.name == "kube-apiserver"), None)
        if index is None:
            raise RuntimeError("kube-apiserver is not running in this cluster")
        stopped = time.monotonic()
        proc = self._replace_process(index, signal.SIGTERM, grace)
        wait_until(
            "kube-apiserver /readyz",
            lambda: http_status(f"{state.server}/readyz", context=self.ssl_context(), token=state.admin_token) == 200,
            timeout=self.config.timeout,
            process=proc,
        )
        took = time.monotonic() - stopped
        _log(f"kube-apiserver restarted ({took:.1f}s)")
        return took

    def _start_controller_manager(self, binaries: build.Binaries, port: int, kubeconfig: Path) -> None:
        controllers = (*CONTROLLERS, *(POD_NETWORK_CONTROLLERS if self.config.pod_network else ()))
        proc = self._spawn(
            "kube-controller-manager",
            [
                str(binaries.kube_controller_manager),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--controllers={','.join(controllers)}",
                f"--root-ca-file={self.pki / 'ca.crt'}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--leader-elect=false",
                # The harness' pods and claims come in bursts; the default 20/s would queue them.
                "--kube-api-qps=200",
                "--kube-api-burst=400",
                "--v=1",
            ],
        )
        self._wait_self_signed("kube-controller-manager", port, proc)

    def _wait_self_signed(self, name: str, port: int, proc: ManagedProcess) -> None:
        """Wait for /healthz of a component serving a certificate it signed itself in memory."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        waited = wait_until(
            f"{name} /healthz",
            lambda: http_status(f"https://127.0.0.1:{port}/healthz", context=context) == 200,
            timeout=self.config.timeout,
            process=proc,
        )
        _log(f"{name} ready on 127.0.0.1:{port} ({waited:.1f}s)")

    def _start_scheduler(
        self, binaries: build.Binaries, name: str, config_path: Path, port: int, kubeconfig: Path,
        extra: Sequence[str] = (),
    ) -> None:
        proc = self._spawn(
            name,
            [
                str(binaries.kube_scheduler),
                f"--config={config_path}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                *extra,
                "--v=2",
            ],
        )
        self._wait_self_signed(name, port, proc)

    # ------------------------------------------------------------------ stop

    def down(self) -> None:
        """Stop every component (newest first) and verify no process of theirs is left."""
        errors = []
        if self._extender_service is not None:
            self._extender_service.stop()
            self._extender_service = None
        for proc in reversed(self.processes):
            try:
                proc.stop()
            except RuntimeError as error:
                errors.append(str(error))
        left = group_members(self.pgids())
        if self.processes:
            (self.directory / PROCESSES_FILE).unlink(missing_ok=True)
            for pid_file in (self.directory / "pids").glob("*.pid"):
                pid_file.unlink()
        self.processes = []
        if self.config.image:
            containers.remove([containers.container_name(name, self.directory) for name in services.SERVICES])
        if errors or left:
            raise RuntimeError(f"processes left behind in {self.directory}: {left} {errors}")


class ExistingCluster:
    """A cluster this harness did not start (kind, a lab cluster), reached through a kubeconfig."""

    def __init__(self, kubeconfig: Path, version: str | None = None) -> None:
        self.kubeconfig = kubeconfig.resolve()
        self.version = version
        """The Kubernetes version the caller expects, if any (not checked against the server)."""

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for the kubeconfig's current context."""
        return kube.api_client(self.kubeconfig)

    def core_v1(self) -> Any:
        """A ``kubernetes.client.CoreV1Api`` for the kubeconfig's current context."""
        return kube.core_v1(self.api_client())


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m e2e.cluster up|down --dir DIR``."""
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a cluster in DIR and wait until it is ready")
    up.add_argument("--dir", required=True, type=Path, help="state, logs and kubeconfig go here")
    up.add_argument("--kube-version", help="Kubernetes version or minor (default $KUBE_VERSION or 1.36)")
    up.add_argument(
        "--second-scheduler",
        action="store_true",
        help="run the extender behind a second scheduler named 'vramguard'",
    )
    mode = up.add_mutually_exclusive_group()
    mode.add_argument(
        "--no-vramguard", dest="vramguard", action="store_const", const="off", help="never start vramguard"
    )
    mode.add_argument(
        "--vramguard", dest="vramguard", action="store_const", const="on", help="require the extender and webhook"
    )
    up.set_defaults(vramguard="auto")
    up.add_argument("--policy", type=Path, help="policy file for the vramguard services")
    up.add_argument(
        "--nodes",
        type=Path,
        metavar="FILE",
        help="create the Nodes of FILE (like examples/nodes.yaml: GPU Feature Discovery labels and the device "
        "plugin's allocatable), Ready, to try vramguard by hand",
    )
    up.add_argument("--timeout", type=float, default=120.0, help="seconds each component may take")
    down = sub.add_parser("down", help="stop the cluster in DIR")
    down.add_argument("--dir", required=True, type=Path)
    down.add_argument("--purge", action="store_true", help="also delete DIR")
    args = parser.parse_args(argv)

    directory: Path = args.dir.resolve()
    if args.command == "up":
        try:
            cluster = Cluster.up(
                directory,
                kube_version=args.kube_version,
                second_scheduler=args.second_scheduler,
                vramguard=args.vramguard,
                policy=args.policy.resolve() if args.policy else None,
                detach=True,
                timeout=args.timeout,
            )
        except (StartupError, build.BuildError, RuntimeError) as error:
            _log(f"error: {error}")
            return 1
        if args.nodes is not None:
            try:
                names = cluster.create_nodes(args.nodes)
            except (OSError, ValueError, urllib.error.HTTPError) as error:
                _log(f"error: cannot create the nodes of {args.nodes}: {error}")
                return 1
            _log(f"created nodes: {', '.join(names)}")
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        return 0

    cluster = Cluster.attach(directory)
    if not cluster.processes:
        _log(f"nothing running in {directory}")
    try:
        cluster.down()
    except RuntimeError as error:
        _log(f"error: {error}")
        return 1
    if args.purge and directory.is_dir():
        shutil.rmtree(directory)
    _log(f"cluster in {directory} stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _scale_up_autoscaler(policy: Path | None) -> str:
    """The ``scale_up.autoscaler`` of the cluster's policy file (``none`` without one)."""
    if policy is None:
        return "none"
    data = yaml.safe_load(policy.read_text(encoding="utf-8")) or {}
    scale_up = data.get("scale_up") if isinstance(data, dict) else None
    return str(scale_up.get("autoscaler", "none")) if isinstance(scale_up, dict) else "none"
