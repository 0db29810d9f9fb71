"""A node's part in replicated ledgers besides the bookie protocol: its identity (the cookie),
its registration in the metadata store, and the guard that lets it reclaim a replica only
once the store says the ledger is gone. Nothing here is imported when ``metadata_url`` is
empty, except the cookie's local file (the journal writes its instance id into headers)."""
