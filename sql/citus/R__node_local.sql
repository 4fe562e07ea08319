-- Citus only: the guard of the functions the coordinator and the workers call once per
-- worker node (composer_claim_node, composer_scan_node, composer_prune_webhooks_node).
-- Each is called with a stream key and reads its node's shards: those placed in the
-- group of the node it runs on (pg_dist_local_group). Citus runs such a call on the
-- node holding the key's shard only when it delegates it; a call it does not delegate
-- (inside a transaction block, the node's metadata not synced, the call made on another
-- node) runs where it was made, on the coordinator most often, whose group holds none
-- of those shards: without this guard it found nothing and said nothing.
-- composer_key_on_this_node: whether the shard of p_key (co-located with the runs) is
-- placed on this node. One index lookup in the local metadata: constant in the number of
-- shards (an empty claim measured the same with and without it; docs/scaling.md).
CREATE OR REPLACE FUNCTION composer_key_on_this_node(p_key TEXT) RETURNS BOOLEAN
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM pg_dist_placement p
                    WHERE p.shardid = get_shard_id_for_distribution_column('workflow_runs', p_key)
                      AND p.groupid = (SELECT groupid FROM pg_dist_local_group))
$$;

-- The error of a call that ran away from its key's node, with SQLSTATE CO421 (the
-- engine's NotDelegated, composer_ops/db/errors.py). Called only on that path.
CREATE OR REPLACE FUNCTION composer_not_delegated(p_function TEXT, p_key TEXT) RETURNS VOID
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%(%) ran on node group %, which does not hold the shard of its key: Citus did not delegate the call',
          p_function, quote_literal(p_key), (SELECT groupid FROM pg_dist_local_group)
        USING ERRCODE = 'CO421',
              HINT = 'Call it in autocommit (not in a transaction block), on the coordinator, with the metadata '
                     'synced to every worker node (pg_dist_node.metadatasynced).';
END;
$$;
