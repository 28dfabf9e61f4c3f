"""Learned allowances (:mod:`vramguard.learning`) kept across restarts and replicas.

Every ``interval`` the serving replica (the leader) reads what the agents measured, moves the table,
applies it to its ledger and writes it to the ConfigMap ``vramguard-learned-allowances`` (data key
``table.json``) in its own namespace, over the ``resourceVersion`` it read; every other replica reads
that ConfigMap and applies it, so that the one taking over serves with the same numbers. At start
the table is read before the first verb is answered: a restart loses nothing.

Each change is logged and posted as an Event on the ConfigMap (``Warning`` when one namespace alone
moved a value, ``Normal`` otherwise), and so is each namespace whose pods hold far more than the rest
of its key's (an outlier, not followed). The table is exported as gauges per key. A ConfigMap that
does not hold a table this module wrote (edited by hand) is reported and replaced by what the
leader learns from then on; a round that fails is logged and counted, and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extender.events import post_object_event
from vramguard.cluster import ClusterState
from vramguard.io.config_record import ConfigRecord
from vramguard.io.kube import ApiError, KubeClient
from vramguard.learning import LEARNED_CONFIGMAP as CONFIGMAP
from vramguard.learning import LEARNED_KEY as DATA_KEY
from vramguard.learning import Change, LearnedTable, LearnedTableError, LearnKey, learning_samples

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_SECONDS = 60.0
STEP_SECONDS = 0.002
"""The longest the round reads nodes before it lets the verbs run (it checks after each node)."""
REST_SECONDS = 0.008
"""How long it then leaves the loop to them: a round takes at most a fifth of the extender's time,
so filters served meanwhile are barely slowed (``python -m bench.learning``); a round over 5,000
nodes then lasts a few seconds, once a minute."""
CHANGED_REASON = "VRAMAllowanceLearned"
OUTLIER_REASON = "VRAMUseOutlier"


class Learner:
    """Keeps the learned table: learns and writes it on the serving replica, follows it elsewhere."""

    def __init__(
        self, state: ClusterState, client: KubeClient, namespace: str, registry: CollectorRegistry,
        serving: Callable[[], bool], *, interval: float = DEFAULT_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.time, rest: float = REST_SECONDS,
    ) -> None:
        self.state = state
        self.client = client
        self.namespace = namespace
        self.serving = serving
        self.interval = interval
        self.clock = clock
        self.rest = rest
        self.table = LearnedTable()
        self._record = ConfigRecord(client, namespace, DATA_KEY,
                                    {"app.kubernetes.io/name": "vramguard", "app.kubernetes.io/component": "extender"})
        self._version: str | None = None
        self._written: str | None = None
        self._outliers: dict[LearnKey, tuple[str, ...]] = {}
        self.changes = Counter("vramguard_learned_allowance_changes",
                               "Changes of a learned allowance (each also an Event on the ConfigMap).",
                               ["direction"], registry=registry)
        self.failures = Counter("vramguard_learned_allowance_round_failures",
                                "Learning rounds that failed (reading or writing the ConfigMap); retried next round.",
                                registry=registry)
        registry.register(_TableCollector(self))

    async def load(self) -> None:
        """Read the stored table and apply it (at start, before the first verb). A table that cannot be
        read is logged; the service starts with what it has."""
        try:
            await self._read()
        except ApiError as exc:
            logger.warning("learned allowances not read (%s); learning from the agents' reports from now on", exc)
        self._apply()

    async def _read(self) -> None:
        stored = await self._record.read(CONFIGMAP)
        self._version = stored.version
        if stored.text is None or stored.text == self._written:
            return
        try:
            self.table = LearnedTable.from_json(stored.text)
        except LearnedTableError as exc:
            logger.error("ConfigMap %s/%s does not hold a learned table (%s): replaced by what is learned from now on",
                         self.namespace, CONFIGMAP, exc)
            return
        self._written = stored.text

    def _apply(self) -> None:
        rules = self.state.policy.learning.rules()
        if self.state.set_learned(self.table.allowances(rules)):
            logger.info("learned allowances applied: %d keys", len(self.state.learned))

    async def round(self) -> list[Change]:
        """One round: learn and write (serving replica) or follow the stored table (the others)."""
        if not self.serving():
            await self._read()
            self._apply()
            return []
        rules = self.state.policy.learning.rules()
        now = self.clock()
        step = time.perf_counter()
        for node in sorted(self.state.node_names()):
            for sample in learning_samples(self.state, (node,)):
                self.table.observe(sample, now)
            if time.perf_counter() - step >= STEP_SECONDS:
                await asyncio.sleep(self.rest)
                step = time.perf_counter()
        self.table.expire(now, rules.max_age_seconds)
        changes = self.table.publish(rules)
        self._apply()
        await self._write()
        for change in changes:
            await self._report(change)
        await self._report_outliers()
        return changes

    async def _write(self) -> None:
        text = self.table.to_json()
        if text == self._written:
            return
        written = await self._record.write(CONFIGMAP, self._version, text)
        if written is None:
            # Written by another replica meanwhile (a leader before this one): this one's table wins.
            self._version = (await self._record.read(CONFIGMAP)).version
            written = await self._record.write(CONFIGMAP, self._version, text)
            if written is None:
                raise ApiError(409, "Conflict", f"ConfigMap {CONFIGMAP} keeps changing under the leader")
        self._written = text
        self._version = written or (await self._record.read(CONFIGMAP)).version

    async def _report(self, change: Change) -> None:
        rising = (change.after or 0) > (change.before or 0)
        self.changes.labels("up" if rising else "down").inc()
        message = change.message()
        (logger.warning if change.single_namespace else logger.info)("%s", message)
        await post_object_event(self.client, self._object(), CHANGED_REASON, message,
                                "Warning" if change.single_namespace else "Normal")

    async def _report_outliers(self) -> None:
        outliers = dict(self.table.outliers())
        for key, namespaces in outliers.items():
            if self._outliers.get(key) == namespaces:
                continue
            message = (f"namespaces {', '.join(namespaces)}: pods of {key.describe()} hold far more beyond their "
                       "certain part than the key's other namespaces; not followed by the learned allowance")
            logger.warning("%s", message)
            await post_object_event(self.client, self._object(), OUTLIER_REASON, message, "Warning")
        self._outliers = outliers

    def _object(self) -> dict[str, str]:
        return {"apiVersion": "v1", "kind": "ConfigMap", "name": CONFIGMAP, "namespace": self.namespace, "uid": ""}

    async def run(self) -> None:
        """A round every ``interval`` until cancelled; a failed round is logged and counted."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.round()
            except Exception:
                self.failures.inc()
                logger.exception("learning round failed; retrying in %g s", self.interval)


class _TableCollector(Collector):
    """The learned table as gauges per key (a few dozen series at most: the table is bounded)."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["engine", "version", "product", "gpus", "layout"]
        value = GaugeMetricFamily("vramguard_learned_allowance_bytes",
                                  "Learned allowance: what pods of a key hold beyond their certain part (share and "
                                  "CUDA context), counted where more than the static estimates.", labels=labels)
        pods = GaugeMetricFamily("vramguard_learned_allowance_pods", "Pods behind a learned allowance.", labels=labels)
        namespaces = GaugeMetricFamily("vramguard_learned_allowance_namespaces",
                                       "Namespaces behind a learned allowance.", labels=labels)
        outliers = GaugeMetricFamily("vramguard_learned_allowance_outlier_namespaces",
                                     "Namespaces whose pods hold far more than the key's learned value (not followed).",
                                     labels=labels)
        learned = self.learner.state.learned
        flagged = self.learner.table.outliers()
        for key in sorted(set(learned) | set(flagged)):
            names = [key.engine, key.version, key.product, str(key.gpus), key.layout]
            allowance = learned.get(key)
            if allowance is not None:
                value.add_metric(names, allowance.bytes)
                pods.add_metric(names, allowance.pods)
                namespaces.add_metric(names, allowance.namespaces)
            outliers.add_metric(names, len(flagged.get(key, ())))
        yield from (value, pods, namespaces, outliers)
