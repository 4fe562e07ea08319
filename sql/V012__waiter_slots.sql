-- Idle workers register their free slots (sql/R__dispatch.sql says how dispatches use
-- them): a registration stands for up to `slots` wake-ups, less those handed out that
-- the worker had not yet taken up when it registered (promised - seen). Both counters
-- are totals over the registration's life, so a wake-up's notification carries the
-- new total and the worker takes the largest it has seen.
ALTER TABLE task_waiters
    ADD COLUMN slots INT NOT NULL DEFAULT 1,
    ADD COLUMN promised BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN seen BIGINT NOT NULL DEFAULT 0;
