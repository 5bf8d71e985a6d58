"""Cluster DNS as hosts files: the A records CoreDNS would serve, written into each pod's
/etc/hosts together with the names the pod's search path (`<ns>.svc.cluster.local`,
`svc.cluster.local`, `cluster.local`) lets it use.

Records come from the Services and the EndpointSlices the real controller-manager writes:
- `<service>.<ns>.svc.cluster.local`: the ready endpoints' addresses (a headless Service's, as
  CoreDNS answers; for a ClusterIP Service also the endpoints, since no kube-proxy turns the
  virtual IP into a pod here, so its port must be the pods' port);
- `<hostname>.<service>.<ns>.svc.cluster.local`: an endpoint that has a hostname, that is a pod
  with `hostname` and `subdomain: <service>`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

CLUSTER_DOMAIN = "cluster.local"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
HEADER = "# Kubernetes-managed hosts file (process kubelet).\n"
LOCALHOST = ("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
             "fe00::0\tip6-localnet\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n")

Records = dict[str, tuple[str, ...]]  # fully qualified name -> addresses


def service_records(services: list[dict[str, Any]], slices: list[dict[str, Any]]) -> Records:
    known = {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in services
             if s["spec"].get("type") != "ExternalName"}
    records: dict[str, set[str]] = defaultdict(set)
    for endpoint_slice in slices:
        namespace = endpoint_slice["metadata"]["namespace"]
        service = (endpoint_slice["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
        if (namespace, service) not in known:
            continue
        name = f"{service}.{namespace}.svc.{CLUSTER_DOMAIN}"
        records.setdefault(name, set())
        for endpoint in endpoint_slice.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue  # unknown (absent) reads as ready, as CoreDNS does
            addresses = endpoint.get("addresses") or []
            records[name].update(addresses)
            if endpoint.get("hostname"):
                records[f"{endpoint['hostname']}.{name}"].update(addresses)
    return {name: tuple(sorted(ips)) for name, ips in records.items() if ips}


def search_names(fqdn: str, namespace: str) -> list[str]:
    """`fqdn` and the shorter names that reach it through a pod's DNS search path."""
    names = [fqdn]
    for domain in (f"{namespace}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN):
        if fqdn.endswith("." + domain):
            names.append(fqdn[:-len(domain) - 1])
    return names


def pod_hostname(pod: dict[str, Any]) -> str:
    return pod["spec"].get("hostname") or pod["metadata"]["name"][:63]


def hosts_file(pod: dict[str, Any], pod_ip: str, records: Records) -> str:
    namespace = pod["metadata"]["namespace"]
    hostname, subdomain = pod_hostname(pod), pod["spec"].get("subdomain")
    own = f"{hostname}.{subdomain}.{namespace}.svc.{CLUSTER_DOMAIN}\t" if subdomain else ""
    lines = [HEADER, LOCALHOST, f"{pod_ip}\t{own}{hostname}\n"]
    for alias in pod["spec"].get("hostAliases") or []:
        lines.append(f"{alias['ip']}\t{' '.join(alias.get('hostnames') or [])}\n")
    for fqdn, ips in sorted(records.items()):
        names = " ".join(search_names(fqdn, namespace))
        lines.extend(f"{ip}\t{names}\n" for ip in ips)
    return "".join(lines)
