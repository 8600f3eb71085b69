"""Reading a stored checkpoint, in layers each importing only those below: where bytes come from (source),
frames into verified buffers (pieces), shard regions (reshard), whole items (reader), live tensors filled in
place (livefill), the checks every reader shares (integrity), and on top the one door readers outside use:
stored.py's StoredCheckpoint."""
