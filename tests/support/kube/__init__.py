"""A real Kubernetes control plane on this machine for the operator and chart tests.

etcd, kube-apiserver and kube-controller-manager (built from their Go modules by
`make kube-tools`) run as children of the test session on 127.0.0.1; the process kubelet
(`tests.support.kube.kubelet`) runs the pods as local processes. `python -m tests.support.kube`
starts the whole cluster by hand.
"""
