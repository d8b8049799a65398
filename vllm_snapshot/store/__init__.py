"""The snapshot format and the store on disk: member names and trust checks (layout), the manifest,
images' checksums and compression (archive), the store's directories, locks, the table of running
engines (registry), the oracle record, the model digest and the snapshot key. Imports host and base only."""
