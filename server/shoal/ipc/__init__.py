"""Messages and sockets between the api, scheduler and detokenizer processes."""
