-- Which Kafka log the stored input offsets belong to (services/common/log_identity.py): the
-- cluster id and each input topic's id, recorded on first use and compared at every start and
-- rebalance. A log with other ids (a wiped broker, a re-created topic) is refused until an
-- operator adopts it; every adoption is kept here with what it gave up.
CREATE TABLE log_identity (
    topic        text PRIMARY KEY,
    cluster_id   text NOT NULL,
    topic_id     uuid NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE log_adoptions (
    id            bigserial PRIMARY KEY,
    actor         text NOT NULL,
    reason        text NOT NULL,
    old_identity  jsonb NOT NULL,   -- {topic: {cluster_id, topic_id}} as recorded before
    new_identity  jsonb NOT NULL,   -- the same for the adopted log
    old_offsets   jsonb NOT NULL,   -- {"topic/partition": next offset} given up
    adopted_at    timestamptz NOT NULL DEFAULT now()
);
