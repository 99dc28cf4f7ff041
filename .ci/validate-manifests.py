#!/usr/bin/env python3
"""Checks the Kubernetes manifests under deploy/ without a cluster.

Every object is validated against kubernetes-validate's strict schemas (an
unknown field is an error) for each Kubernetes version asked for; a kind with
no schema is an error too (the tool itself only warns, so a misspelt kind or
apiVersion would pass). The API server also enforces rules that no OpenAPI
schema states: the ones a manifest here could break are checked below. The
kustomizations (deploy/ and the opt-in deploy/webhook/) are rendered with
`kubectl kustomize` where kubectl is installed and their output validated the
same way. Custom resources, which no Kubernetes schema covers (cert-manager's,
the Prometheus Operator's), are validated against the strict schemas in
.ci/schemas/.

Before all that, known-broken objects are fed through the same checks and each
must be refused, so a checker that accepts everything fails loudly.

Usage: validate-manifests.py --kubernetes-version 1.30.0 [...] DEPLOY_DIR
"""

import argparse
import copy
import pathlib
import shutil
import subprocess
import sys

import jsonschema
import yaml
from kubernetes_validate import utils as schemas

# Directories under deploy/ that are opt-in on purpose: validated, but not
# expected in the kustomization. An opt-in directory with a kustomization of
# its own (webhook/) must list every manifest in it there instead.
OPT_IN_DIRS = ("examples", "monitoring", "optional", "webhook")

# Schemas of custom resources: one file per API group, each naming its
# apiVersion and holding shared definitions beside one schema per kind.
CRD_SCHEMA_DIR = pathlib.Path(__file__).parent / "schemas"


def crd_schemas():
    schemas = {}
    for path in sorted(CRD_SCHEMA_DIR.glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        api_version, definitions = document.pop("apiVersion"), document.pop("definitions")
        for kind, schema in document.items():
            schemas[(api_version, kind)] = dict(schema, definitions=definitions)
    return schemas


CRD_SCHEMAS = crd_schemas()

# The webhook's safety rules (issue 6): never block a pod, never the
# control plane's or the supervisor's own namespace, answer well within
# the API server's own timeout.
PROTECTED_NAMESPACES = ("kube-system", "fuse-supervisor")
WEBHOOK_MAX_TIMEOUT = 10

CAPABILITIES = {
    "AUDIT_CONTROL", "AUDIT_READ", "AUDIT_WRITE", "BLOCK_SUSPEND", "BPF", "CHECKPOINT_RESTORE", "CHOWN",
    "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "IPC_LOCK", "IPC_OWNER", "KILL", "LEASE",
    "LINUX_IMMUTABLE", "MAC_ADMIN", "MAC_OVERRIDE", "MKNOD", "NET_ADMIN", "NET_BIND_SERVICE", "NET_BROADCAST",
    "NET_RAW", "PERFMON", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYSLOG", "SYS_ADMIN", "SYS_BOOT",
    "SYS_CHROOT", "SYS_MODULE", "SYS_NICE", "SYS_PACCT", "SYS_PTRACE", "SYS_RAWIO", "SYS_RESOURCE", "SYS_TIME",
    "SYS_TTY_CONFIG", "WAKE_ALARM",
}

# Closed sets of values the API server checks but the schemas leave open.
SECURITY_PROFILE_TYPES = {"RuntimeDefault", "Unconfined", "Localhost"}
MOUNT_PROPAGATIONS = {"None", "HostToContainer", "Bidirectional"}
HOST_PATH_TYPES = {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"}


def name_of(obj):
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('name')}"


def pod_specs(obj):
    """(where, pod spec, pod template labels or None) of a pod or workload."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind == "Pod":
        yield "spec", spec, None
    elif kind in ("DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"):
        template = spec.get("template") or {}
        yield "spec.template.spec", template.get("spec") or {}, (template.get("metadata") or {}).get("labels") or {}
    elif kind == "CronJob":
        template = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
        yield "spec.jobTemplate.spec.template.spec", template.get("spec") or {}, None


def containers(pod):
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for index, container in enumerate(pod.get(field) or []):
            yield f"{field}[{index}]", container


def api_server_rules(obj):
    """What the API server would refuse although the schema accepts it."""
    errors = []
    if not (obj.get("metadata") or {}).get("name"):
        errors.append("metadata.name: missing")
    if obj.get("kind") == "MutatingWebhookConfiguration":
        errors += webhook_rules(obj)
    selector = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    for where, pod, template_labels in pod_specs(obj):
        if template_labels is not None and obj.get("kind") != "Job":
            if not selector:
                errors.append("spec.selector.matchLabels: empty")
            for key, value in selector.items():
                if template_labels.get(key) != value:
                    errors.append(f"spec.selector.matchLabels.{key}: not a label of the pod template")
        errors += pod_rules(where, pod)
    return errors


def pod_rules(where, pod):
    errors = []
    if pod.get("hostPID") and pod.get("shareProcessNamespace"):
        errors.append(f"{where}: hostPID and shareProcessNamespace cannot both be set")
    for volume in pod.get("volumes") or []:
        kind = (volume.get("hostPath") or {}).get("type", "")
        if kind not in HOST_PATH_TYPES:
            errors.append(f"{where}.volumes[{volume.get('name')}].hostPath.type: unknown type {kind}")
    errors += profile_rules(f"{where}.securityContext", pod.get("securityContext") or {})
    volumes = {volume.get("name") for volume in pod.get("volumes") or []}
    for path, container in containers(pod):
        errors += container_rules(f"{where}.{path}", container, volumes)
    return errors


def container_rules(at, container, volumes):
    errors = []
    context = container.get("securityContext") or {}
    errors += profile_rules(f"{at}.securityContext", context)
    privileged = context.get("privileged") is True
    caps = context.get("capabilities") or {}
    for field in ("add", "drop"):
        for cap in caps.get(field) or []:
            if cap.removeprefix("CAP_") not in CAPABILITIES and not (field == "drop" and cap == "ALL"):
                errors.append(f"{at}.securityContext.capabilities.{field}: unknown capability {cap}")
    added = {cap.removeprefix("CAP_") for cap in caps.get("add") or []}
    if context.get("allowPrivilegeEscalation") is False and (privileged or "SYS_ADMIN" in added):
        errors.append(f"{at}.securityContext: allowPrivilegeEscalation false with privileged or SYS_ADMIN")
    for mount in container.get("volumeMounts") or []:
        name, propagation = mount.get("name"), mount.get("mountPropagation", "None")
        if name not in volumes:
            errors.append(f"{at}.volumeMounts: no volume named {name}")
        if propagation not in MOUNT_PROPAGATIONS:
            errors.append(f"{at}.volumeMounts[{name}]: unknown mountPropagation {propagation}")
        if propagation == "Bidirectional" and not privileged:
            errors.append(f"{at}.volumeMounts[{name}]: Bidirectional needs a privileged container")
    ports = {port.get("name") for port in container.get("ports") or [] if port.get("name")}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        for handler in ("httpGet", "tcpSocket"):
            port = ((container.get(probe) or {}).get(handler) or {}).get("port")
            if isinstance(port, str) and port not in ports:
                errors.append(f"{at}.{probe}.{handler}.port: no container port named {port}")
    return errors


def webhook_rules(obj):
    """The API server's rules for a webhook configuration, and the project's
    safety rules on top."""
    errors = []
    for index, hook in enumerate(obj.get("webhooks") or []):
        at = f"webhooks[{index}]"
        if len((hook.get("name") or "").split(".")) < 3:
            errors.append(f"{at}.name: must be fully qualified, e.g. name.example.com")
        if "v1" not in (hook.get("admissionReviewVersions") or []):
            errors.append(f"{at}.admissionReviewVersions: must include v1 (the only version served)")
        if hook.get("sideEffects") not in ("None", "NoneOnDryRun"):
            errors.append(f"{at}.sideEffects: must be None or NoneOnDryRun")
        timeout = hook.get("timeoutSeconds", 10)
        if not 1 <= timeout <= 30:
            errors.append(f"{at}.timeoutSeconds: must be between 1 and 30")
        elif timeout > WEBHOOK_MAX_TIMEOUT:
            errors.append(f"{at}.timeoutSeconds: {timeout} is not well under the API server's 10")
        if hook.get("failurePolicy") != "Ignore":
            errors.append(f"{at}.failurePolicy: must be Ignore, a webhook outage must never block pods")
        service = (hook.get("clientConfig") or {}).get("service") or {}
        if service and not (service.get("path") or "/").startswith("/"):
            errors.append(f"{at}.clientConfig.service.path: must start with /")
        excluded = set()
        for expression in (hook.get("namespaceSelector") or {}).get("matchExpressions") or []:
            if expression.get("key") == "kubernetes.io/metadata.name" and expression.get("operator") == "NotIn":
                excluded |= set(expression.get("values") or [])
        for namespace in PROTECTED_NAMESPACES:
            if namespace not in excluded:
                errors.append(f"{at}.namespaceSelector: does not exclude namespace {namespace}")
    return errors


def reference_rules(objects):
    """References between objects: webhook services and CA injection sources exist."""
    errors = []
    by_kind = {}
    for obj in objects:
        meta = obj.get("metadata") or {}
        by_kind.setdefault(obj.get("kind"), {})[(meta.get("namespace"), meta.get("name"))] = obj
    for (_, name), obj in (by_kind.get("MutatingWebhookConfiguration") or {}).items():
        inject = ((obj.get("metadata") or {}).get("annotations") or {}).get("cert-manager.io/inject-ca-from")
        if inject and tuple(inject.split("/", 1)) not in (by_kind.get("Certificate") or {}):
            errors.append(f"MutatingWebhookConfiguration/{name}: inject-ca-from {inject}: no such Certificate")
        for hook in obj.get("webhooks") or []:
            service = (hook.get("clientConfig") or {}).get("service")
            if not service:
                continue
            target = (by_kind.get("Service") or {}).get((service.get("namespace"), service.get("name")))
            ports = [port.get("port") for port in ((target or {}).get("spec") or {}).get("ports") or []]
            if target is None:
                errors.append(f"MutatingWebhookConfiguration/{name}: no Service {service.get('namespace')}/"
                              f"{service.get('name')}")
            elif service.get("port", 443) not in ports:
                errors.append(f"MutatingWebhookConfiguration/{name}: Service {service.get('name')} has no port "
                              f"{service.get('port', 443)}")
    return errors


def profile_rules(at, context):
    errors = []
    for profile in ("seccompProfile", "appArmorProfile"):
        kind = (context.get(profile) or {}).get("type")
        if kind is not None and kind not in SECURITY_PROFILE_TYPES:
            errors.append(f"{at}.{profile}.type: unknown type {kind}")
    return errors


def check(obj, versions):
    """Every complaint about one object, schema and API-server rules."""
    errors = []
    crd = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if crd is not None:
        for error in jsonschema.Draft7Validator(crd).iter_errors(obj):
            path = ".".join(str(part) for part in error.path)
            errors.append(f"{obj.get('apiVersion')} schema: {path}: {error.message}")
        return errors + api_server_rules(obj)
    for version in versions:
        try:
            schemas.validate(obj, version, strict=True)
        except schemas.ValidationError as err:
            path = ".".join(str(part) for part in err.path)
            errors.append(f"Kubernetes {version}: {path}: {err.message}")
        except schemas.SchemaNotFoundError as err:
            errors.append(err.message)
    return errors + api_server_rules(obj)


def documents(text, origin):
    try:
        return [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as err:
        raise SystemExit(f"error {origin}: not YAML: {err}")


def self_test(versions, good):
    """The checks must refuse objects broken in ways they claim to catch."""
    daemonset = next((obj for obj in good if obj.get("kind") == "DaemonSet"), None)
    if daemonset is None:
        raise SystemExit("error self-test: no DaemonSet under deploy/ to break")

    def broken(change):
        obj = copy.deepcopy(daemonset)
        change(obj)
        return obj

    pod = lambda obj: obj["spec"]["template"]["spec"]  # noqa: E731
    first = lambda obj: pod(obj)["containers"][0]  # noqa: E731
    cases = {
        "an unknown field": broken(lambda obj: pod(obj).update(hostPid=True)),
        "a kind without schema": broken(lambda obj: obj.update(kind="DeamonSet")),
        "Bidirectional without privileged": broken(
            lambda obj: first(obj).setdefault("volumeMounts", []).append(
                {"name": "state", "mountPath": "/x", "mountPropagation": "Bidirectional"})),
        "a misspelt seccomp profile type": broken(
            lambda obj: first(obj)["securityContext"].update(seccompProfile={"type": "Unconfinde"})),
        "an unknown capability": broken(
            lambda obj: first(obj)["securityContext"]["capabilities"]["add"].append("SYS_PTRAC")),
        "a selector the template lacks": broken(
            lambda obj: obj["spec"]["selector"]["matchLabels"].update(extra="label")),
    }
    webhook = next((obj for obj in good if obj.get("kind") == "MutatingWebhookConfiguration"), None)
    certificate = next((obj for obj in good if obj.get("kind") == "Certificate"), None)
    if webhook is None or certificate is None:
        raise SystemExit("error self-test: no MutatingWebhookConfiguration or Certificate under deploy/ to break")

    def broken_copy(template, change):
        obj = copy.deepcopy(template)
        change(obj)
        return obj

    hook = lambda obj: obj["webhooks"][0]  # noqa: E731
    cases.update({
        "webhook failurePolicy Fail": broken_copy(webhook, lambda obj: hook(obj).update(failurePolicy="Fail")),
        "webhook sent kube-system": broken_copy(
            webhook, lambda obj: hook(obj)["namespaceSelector"]["matchExpressions"][0].update(values=["other"])),
        "webhook timeout of 31 s": broken_copy(webhook, lambda obj: hook(obj).update(timeoutSeconds=31)),
        "Certificate with a misspelt field": broken_copy(
            certificate, lambda obj: obj["spec"].update(dnsName=["x"])),
    })
    for kind in ("PodMonitor", "PrometheusRule"):
        monitoring = next((obj for obj in good if obj.get("kind") == kind), None)
        if monitoring is None:
            raise SystemExit(f"error self-test: no {kind} under deploy/ to break")
        cases[f"{kind} with a misspelt field"] = broken_copy(monitoring, lambda obj: obj["spec"].update(selektor={}))
    for what, obj in cases.items():
        if not check(obj, versions):
            raise SystemExit(f"error self-test: an object with {what} was accepted")
    others = [obj for obj in good if obj is not webhook]
    if not reference_rules(others + [broken_copy(webhook, lambda obj: hook(obj)["clientConfig"]["service"].update(
            name="missing"))]):
        raise SystemExit("error self-test: a webhook calling a missing Service was accepted")
    print(f"self-test: {len(cases) + 1} broken objects refused")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubernetes-version", action="append", required=True, dest="versions")
    parser.add_argument("deploy", type=pathlib.Path)
    args = parser.parse_args()

    files = sorted(path for path in args.deploy.rglob("*") if path.suffix in (".yaml", ".yml"))
    kustomization = args.deploy / "kustomization.yaml"
    kustomizations = [path for path in files if path.name == "kustomization.yaml"]
    listed = set()
    objects = []  # (origin, object)
    failures = []
    for path in files:
        for doc in documents(path.read_text(), path):
            if doc.get("kind") == "Kustomization":
                for resource in doc.get("resources") or []:
                    target = path.parent / resource
                    if not target.is_file():
                        failures.append(f"{path}: resource {resource} does not exist")
                    listed.add(target.resolve())
            else:
                objects.append((path, doc))
    for path in files:
        relative = path.relative_to(args.deploy)
        if path in kustomizations or path.resolve() in listed:
            continue
        own = args.deploy / relative.parts[0] / "kustomization.yaml"
        if len(relative.parts) > 1 and own in kustomizations:
            failures.append(f"{path}: not in {own}")
        elif relative.parts[0] not in OPT_IN_DIRS:
            opt_in = " or ".join(f"{directory}/" for directory in OPT_IN_DIRS)
            failures.append(f"{path}: neither in {kustomization} nor under {opt_in}")

    self_test(args.versions, [obj for _, obj in objects])

    failures += reference_rules([obj for _, obj in objects])

    kubectl = shutil.which("kubectl")
    for path in kustomizations:
        directory = path.parent
        if not kubectl:
            print(f"WARNING: kubectl not found; {path} was not rendered (its resources were checked to exist)")
            continue
        rendered = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True)
        if rendered.returncode != 0:
            failures.append(f"kubectl kustomize {directory}: {rendered.stderr.strip()}")
        else:
            objects += [(f"kubectl kustomize {directory}", obj) for obj in documents(rendered.stdout, "kustomize")]

    passed = 0
    for origin, obj in objects:
        errors = check(obj, args.versions)
        for error in errors:
            failures.append(f"{origin}: {name_of(obj)}: {error}")
        if not errors:
            passed += 1
            print(f"ok {origin}: {name_of(obj)}")
    for failure in failures:
        print(f"error {failure}")
    print(f"manifests: {passed} passed, {len(failures)} failed (Kubernetes {', '.join(args.versions)}, strict)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
