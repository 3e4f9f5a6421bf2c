-- NOTIFY channels are one namespace per database: each sandstream sharing a database under a
-- schema of its own (SANDSTREAM_PG_SCHEMA) notifies and listens on its schema's channels, so
-- none wakes on another's commits. The public schema keeps the bare names (those of earlier
-- versions); a name over PostgreSQL's 63 bytes takes the schema's md5 in its place. Senders
-- call it in their NOTIFY, listeners ask it for the name to LISTEN on.
CREATE FUNCTION notify_channel(base text) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT CASE
    WHEN current_schema() = 'public' THEN base
    WHEN octet_length(base || ':' || current_schema()) <= 63 THEN base || ':' || current_schema()
    ELSE base || ':' || md5(current_schema())
  END
$$;
