"""The process kubelet: runs the test cluster's pods as local processes.

    python -m tests.support.kube.kubelet --kubeconfig K --state-dir D --node-name N

It registers a Ready Node, binds pending pods to it (there is no scheduler), and runs each
container as a process tree in its own mount, UTS and PID namespaces (`sandbox.py`), on the
host's network with a loopback address of its own (`status.podIP` in 127.0.0.0/8). See
docs/kubernetes.md ("The test cluster") for what it emulates and what it does not.
"""
