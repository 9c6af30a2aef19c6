"""Ray clusters: reaching one (connect), a head on this machine (local), cluster.yaml through
Ray's launcher (launcher), training sent as a job (jobs), waiting for an autoscaler (autoscale)."""
