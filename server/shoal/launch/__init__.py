"""One launch plan for a server node, and the runner that supervises it as child processes."""
