"""`shoal router`: one OpenAI-compatible front for many servers (docs/pd.md, "The router").

    args.py          its command line
    prefix_index.py  the approximate prefix tree of each worker (chained block hashes, LRU)
    policies.py      random, round_robin, power_of_two, cache_aware: which worker takes a request
    workers.py       the workers: their role (from /server_info), health, load; discovery
    proxy.py         forwarding: to one colocated worker, or to a prefill/decode pair at once
    app.py           the routes
    main.py          the process (`shoal::router`)
"""
