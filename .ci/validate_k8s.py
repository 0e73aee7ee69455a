#!/usr/bin/env python3
"""Offline validation of the Kubernetes manifests in examples/kubernetes/.

1. Schema: every document against the Kubernetes JSON schemas shipped inside the
   kubernetes-validate package (no network), in strict mode (unknown fields are errors), for
   each requested Kubernetes version. A kind/apiVersion without a schema is an error too (the
   package's own CLI only warns).
2. Consistency checks the schemas cannot express: selectors that select, references to
   ConfigMaps/Secrets/volumes/ports that exist, `restartPolicy` values, and idemgate's own
   settings against the pod that runs it (probe port = admin port, drain budget within
   terminationGracePeriodSeconds, ConfigMap mounted as a directory, writable dead-letter dir;
   a `--reconcile` Job's file beside the config's dead_letter_path, on a StatefulSet's claim).

Usage: validate_k8s.py [-k VERSION]... FILE...
"""

import argparse
import os
import re
import sys

import yaml
import kubernetes_validate
from kubernetes_validate.utils import VersionNotSupportedError

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}

errors = []


def error(where, message):
    errors.append(f"{where}: {message}")


def load(files):
    docs = []
    for path in files:
        with open(path) as f:
            try:
                for doc in yaml.safe_load_all(f):
                    if doc:
                        docs.append((os.path.basename(path), doc))
            except yaml.YAMLError as e:
                error(path, f"invalid YAML: {e}")
    return docs


def ident(doc):
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind', '?')}/{meta.get('name', '?')}"


# --- 1. schemas ---------------------------------------------------------------------------------

def check_schemas(docs, versions):
    """Returns how many (object, version) validations passed."""
    total = 0
    for version in versions:
        passed = 0
        for file, doc in docs:
            where = f"{file} {ident(doc)} (Kubernetes {version})"
            if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
                error(where, "not a Kubernetes object (apiVersion and kind are required)")
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
                passed += 1
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path) or "(root)"
                error(where, f"{path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                error(where, e.message)
            except VersionNotSupportedError as e:
                sys.exit(f"kubernetes-validate {kubernetes_validate.__version__}: {e.message}")
        print(f"schema: {passed}/{len(docs)} objects valid against Kubernetes {version} (strict)")
        total += passed
    return total


# --- 2. consistency -----------------------------------------------------------------------------

def labels_match(selector, labels):
    """A label selector's matchLabels (or a Service's plain selector) against pod labels."""
    if "matchLabels" in selector or "matchExpressions" in selector:
        if selector.get("matchExpressions"):
            raise SystemExit("validate_k8s.py: matchExpressions selectors are not supported here")
        want = selector.get("matchLabels") or {}
    else:
        want = selector
    return bool(want) and all(labels.get(k) == v for k, v in want.items())


def pod_containers(pod):
    return [(c, True) for c in pod.get("initContainers") or []] + [
        (c, False) for c in pod.get("containers") or []
    ]


def named_ports(container):
    return {p.get("name"): p.get("containerPort") for p in container.get("ports") or [] if p.get("name")}


def numeric_ports(container):
    return {p.get("containerPort") for p in container.get("ports") or []}


def parse_duration(text):
    """Seconds in an idemgate duration (250ms, 20s, 1h30m); None if not one."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        return None
    return sum(int(n) * units[u] for n, u in parts)


def prestop_sleep(container):
    """Seconds a preStop hook sleeps (exec `sleep N` or the sleep action), else 0."""
    pre = ((container.get("lifecycle") or {}).get("preStop")) or {}
    if "sleep" in pre:
        return int(pre["sleep"].get("seconds", 0))
    command = (pre.get("exec") or {}).get("command") or []
    if len(command) == 2 and os.path.basename(str(command[0])) == "sleep":
        try:
            seconds = float(command[1])
        except ValueError:
            return 0
        return int(seconds) if seconds.is_integer() else seconds
    return 0


def check_consistency(docs):
    by_kind = {}
    for file, doc in docs:
        key = (doc.get("kind"), (doc.get("metadata") or {}).get("name"))
        if key in by_kind:
            error(f"{file} {ident(doc)}", f"defined twice (also in {by_kind[key][0]})")
        by_kind[key] = (file, doc)
    configmaps = {n: d for (k, n), (_, d) in by_kind.items() if k == "ConfigMap"}
    secrets = {n: d for (k, n), (_, d) in by_kind.items() if k == "Secret"}
    workloads = [(f, d) for f, d in docs if d.get("kind") in WORKLOAD_KINDS]
    # The PersistentVolumeClaims StatefulSets make: <template>-<statefulset>-<ordinal>.
    statefulset_claims = [
        f"{(t.get('metadata') or {}).get('name')}-{d['metadata']['name']}"
        for _, d in workloads if d.get("kind") == "StatefulSet"
        for t in (d.get("spec") or {}).get("volumeClaimTemplates") or []
    ]

    for file, doc in workloads:
        where = f"{file} {ident(doc)}"
        spec = doc.get("spec") or {}
        template = spec.get("template") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        selector = spec.get("selector") or {}
        if doc["kind"] != "Job" and not labels_match(selector, labels):
            error(where, f"spec.selector {selector} does not select the pod template's labels {labels}")
        # A StatefulSet's volumeClaimTemplates are volumes of its pods too.
        claims = [(t.get("metadata") or {}).get("name") for t in spec.get("volumeClaimTemplates") or []]
        check_pod(where, template.get("spec") or {}, configmaps, secrets, claims, statefulset_claims)
        if doc["kind"] == "StatefulSet":
            governing = spec.get("serviceName")
            services = {n for (k, n) in by_kind if k == "Service"}
            if governing and governing not in services:
                error(where, f"serviceName {governing!r} is not a Service defined here")

    for kind in ("Service", "PodDisruptionBudget"):
        for file, doc in docs:
            if doc.get("kind") != kind:
                continue
            where = f"{file} {ident(doc)}"
            spec = doc.get("spec") or {}
            selector = spec.get("selector") or {}
            pods = [
                d["spec"]["template"] for _, d in workloads
                if labels_match(selector, (d["spec"]["template"].get("metadata") or {}).get("labels") or {})
            ]
            if not pods:
                error(where, f"selector {selector} matches no pod template in these manifests")
                continue
            if kind == "Service":
                for port in spec.get("ports") or []:
                    check_target_port(where, port, pods)


def check_target_port(where, port, pods):
    target = port.get("targetPort", port.get("port"))
    for pod in pods:
        spec = pod.get("spec") or {}
        if isinstance(target, int):
            if not any(target in numeric_ports(c) for c, _ in pod_containers(spec)):
                error(where, f"targetPort {target} is not a containerPort of the selected pods")
        else:
            regular = any(target in named_ports(c) for c in spec.get("containers") or [])
            sidecar = any(target in named_ports(c) for c in spec.get("initContainers") or [])
            if sidecar and not regular:
                error(where, f"targetPort {target!r} names a port of an init (sidecar) container: "
                             "Services resolve those only from Kubernetes 1.32; use the number")
            elif not regular:
                error(where, f"targetPort {target!r} is not a named port of the selected pods")


def check_pod(where, pod, configmaps, secrets, claims=(), statefulset_claims=()):
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    for claim in claims:
        if claim in volumes:
            error(where, f"volumeClaimTemplate {claim!r} is also a volume of the pod")
    mountable = set(volumes) | set(claims)
    seen = set()
    for v in volumes.values():
        if "configMap" in v and v["configMap"].get("name") not in configmaps and not v["configMap"].get("optional"):
            error(where, f"volume {v['name']}: ConfigMap {v['configMap'].get('name')!r} is not defined")
        if "secret" in v and v["secret"].get("secretName") not in secrets and not v["secret"].get("optional"):
            error(where, f"volume {v['name']}: Secret {v['secret'].get('secretName')!r} is not defined")
    for container, is_init in pod_containers(pod):
        name = container.get("name")
        cwhere = f"{where} container {name}"
        if name in seen:
            error(cwhere, "container name used twice")
        seen.add(name)
        policy = container.get("restartPolicy")
        if is_init and policy is not None and policy != "Always":
            error(cwhere, f"restartPolicy {policy!r}: an init container accepts only \"Always\" "
                          "(a native sidecar)")
        if not is_init and policy is not None:
            error(cwhere, "restartPolicy on a regular container is not accepted by Kubernetes "
                          "1.29-1.33 (it makes init containers sidecars)")
        if is_init and policy is None:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    error(cwhere, f"{probe} is only allowed on sidecar init containers")
        for mount in container.get("volumeMounts") or []:
            if mount.get("name") not in mountable:
                error(cwhere, f"volumeMount {mount.get('name')!r} names no volume of the pod")
            elif "configMap" in volumes.get(mount["name"], {}) and mount.get("subPath"):
                error(cwhere, f"volumeMount {mount['name']!r} uses subPath: a subPath mount never "
                              "receives ConfigMap updates (mount the directory)")
        for env in container.get("env") or []:
            source = env.get("valueFrom") or {}
            for ref_kind, pool in (("secretKeyRef", secrets), ("configMapKeyRef", configmaps)):
                ref = source.get(ref_kind)
                if not ref or ref.get("optional"):
                    continue
                obj = pool.get(ref.get("name"))
                keys = set(((obj or {}).get("data") or {}).keys()) | set(((obj or {}).get("stringData") or {}).keys())
                if obj is None:
                    error(cwhere, f"env {env['name']}: {ref_kind} {ref.get('name')!r} is not defined")
                elif ref.get("key") not in keys:
                    error(cwhere, f"env {env['name']}: {ref.get('name')!r} has no key {ref.get('key')!r}")
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(probe_name) or {}
            for action in ("httpGet", "tcpSocket", "grpc"):
                if action in probe:
                    port = probe[action].get("port")
                    # A name is resolved against the container itself; a number is any port on
                    # the pod's IP (an application reached only through its sidecar is probed
                    # through the sidecar's port).
                    pod_ports = set().union(*(numeric_ports(c) for c, _ in pod_containers(pod)))
                    ok = port in named_ports(container) if isinstance(port, str) else port in pod_ports
                    if not ok:
                        error(cwhere, f"{probe_name}.{action}.port {port!r} is not a port of this pod's containers")
        check_idemgate(cwhere, pod, container, volumes, configmaps, statefulset_claims)


def container_option(container, names):
    """The value of the first of `names` (`--name VALUE` or `--name=VALUE`) in the argv."""
    argv = list(container.get("command") or []) + list(container.get("args") or [])
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            return argv[i + 1]
        for name in names:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def container_config_path(container):
    return container_option(container, ("--config", "-c"))


def check_reconcile(where, container, config, dead_letters, volumes, claims):
    """An `idemgate --reconcile FILE` run: FILE on a mounted volume, where the config's proxy
    writes its dead letters, and a claim that is one of a StatefulSet defined here."""
    dead = ((config.get("store") or {}).get("completion_retry") or {}).get(
        "dead_letter_path", "idemgate-dead-letter.jsonl")
    if os.path.dirname(dead_letters) != os.path.dirname(dead):
        error(where, f"--reconcile {dead_letters} is not beside the config's dead_letter_path {dead}")
    mount = next((m for m in container.get("volumeMounts") or []
                  if (os.path.dirname(dead_letters) + "/").startswith(m["mountPath"].rstrip("/") + "/")), None)
    if mount is None:
        error(where, f"--reconcile {dead_letters} is on no volume: it would read the image's file system")
        return
    claim = (volumes.get(mount.get("name"), {}).get("persistentVolumeClaim") or {}).get("claimName")
    if claim is not None and not any(re.fullmatch(re.escape(c) + r"-\d+", claim) for c in claims):
        error(where, f"claimName {claim!r} is no replica's claim of a StatefulSet here "
                     f"({', '.join(c + '-<N>' for c in claims) or 'none'})")


def check_idemgate(where, pod, container, volumes, configmaps, statefulset_claims=()):
    """idemgate's config against the pod that runs it."""
    if "idemgate" not in str(container.get("image", "")):
        return
    path = container_config_path(container)
    if path is None:
        error(where, "idemgate without --config")
        return
    directory, file = os.path.dirname(path), os.path.basename(path)
    mount = next((m for m in container.get("volumeMounts") or [] if m.get("mountPath").rstrip("/") == directory), None)
    volume = volumes.get((mount or {}).get("name"), {})
    if mount is None or "configMap" not in volume:
        error(where, f"{directory} is not a ConfigMap volume mount (config {path})")
        return
    cm = configmaps.get(volume["configMap"].get("name"))
    text = ((cm or {}).get("data") or {}).get(file)
    if text is None:
        error(where, f"ConfigMap {volume['configMap'].get('name')!r} has no key {file!r}")
        return
    config = yaml.safe_load(text) or {}
    dead_letters = container_option(container, ("--reconcile",))
    if dead_letters is not None:
        # A one-shot command: it listens on nothing, and never drains or leases a worker id.
        check_reconcile(where, container, config, dead_letters, volumes, statefulset_claims)
        return

    def port_of(addr):
        return int(str(addr).rpartition(":")[2])

    listen = config.get("listen", "0.0.0.0:6180")
    admin = (config.get("admin") or {}).get("listen", "127.0.0.1:6181")
    if port_of(listen) not in numeric_ports(container):
        error(where, f"listen {listen} is not a containerPort")
    probed = False
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = (container.get(probe_name) or {}).get("httpGet")
        if not get:
            continue
        probed = True
        port = get.get("port")
        port = named_ports(container).get(port) if isinstance(port, str) else port
        if port != port_of(admin):
            error(where, f"{probe_name} probes port {port}, but admin.listen is {admin}")
        if get.get("path") not in ("/healthz", "/readyz"):
            error(where, f"{probe_name} path {get.get('path')!r}: idemgate answers /healthz and /readyz")
    host = str(admin).rpartition(":")[0].strip("[]")
    if probed and (host.startswith("127.") or host in ("localhost", "::1")):
        error(where, f"admin.listen {admin} is loopback: the kubelet probes the pod IP")

    shutdown = config.get("shutdown") or {}
    grace = parse_duration(shutdown.get("grace_period", "20s"))
    stop = parse_duration(shutdown.get("graceful_shutdown_timeout", "5s"))
    budget = pod.get("terminationGracePeriodSeconds", 30)
    if grace is None or stop is None:
        error(where, "shutdown durations are not idemgate durations")
    else:
        # A native sidecar gets SIGTERM only once the application containers have exited:
        # their preStop hooks come first (their own drain too, which no manifest declares: the
        # message says what is left for it). At exit idemgate takes up to 5 s more: 4 s for the
        # last dead letters, then the log flush.
        sidecar = container.get("restartPolicy") == "Always"
        apps = max((prestop_sleep(c) for c in pod.get("containers") or []), default=0) if sidecar else 0
        exit_flush = 5
        needed = apps + prestop_sleep(container) + grace + stop + exit_flush
        if needed > budget:
            error(where, f"application preStop {apps}s + preStop {prestop_sleep(container)}s + "
                         f"shutdown.grace_period {grace}s + graceful_shutdown_timeout {stop}s + "
                         f"{exit_flush}s exit flush = {needed}s does not fit "
                         f"terminationGracePeriodSeconds {budget}")
        elif sidecar:
            print(f"{where}: {budget - needed}s of terminationGracePeriodSeconds {budget} left "
                  f"for the application's own drain")

    read_only = (container.get("securityContext") or {}).get("readOnlyRootFilesystem")
    dead = ((config.get("store") or {}).get("completion_retry") or {}).get(
        "dead_letter_path", "idemgate-dead-letter.jsonl")
    if read_only:
        if not os.path.isabs(dead):
            error(where, f"dead_letter_path {dead!r} is relative, on a read-only root filesystem")
        else:
            writable = [m for m in container.get("volumeMounts") or []
                        if not m.get("readOnly") and (os.path.dirname(dead) + "/").startswith(m["mountPath"].rstrip("/") + "/")]
            if not writable:
                error(where, f"dead_letter_path {dead} is on no writable volume (read-only root)")

    names = {e.get("name") for e in container.get("env") or []}
    if (config.get("idempotency") or {}).get("worker_id") is None and "POD_NAME" not in names:
        error(where, "idempotency.worker_id unset and no POD_NAME env: the worker id would come "
                     "from the host name")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", "--kubernetes-version", action="append", dest="versions")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    versions = args.versions or ["1.29"]
    print(f"kubernetes-validate {kubernetes_validate.__version__}; files: "
          + " ".join(os.path.basename(f) for f in args.files))
    docs = load(args.files)
    before = len(errors)
    schema_passed = check_schemas(docs, versions)
    schema_errors = len(errors) - before
    check_consistency(docs)
    consistency_errors = len(errors) - schema_errors
    print(f"consistency: {consistency_errors} problem(s) in {len(docs)} objects")
    for e in errors:
        print(f"ERROR {e}")
    # Schema validations per object and version, plus the consistency pass over all objects.
    passed = schema_passed + (1 if consistency_errors == 0 else 0)
    print(f"manifests: {passed} passed, {len(errors)} failed")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
