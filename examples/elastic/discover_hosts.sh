#!/bin/sh
# Host discovery for commlayerrun's elastic driver: print the hosts available now, one
# "host:slots" a line; the driver runs this every second. Here: the lines of the file
# ELASTIC_HOSTS_FILE (edit it while the job runs to add or remove hosts), else this machine
# under two names with one slot each: a failed worker blacklists its host (as in Horovod), so
# two names let one machine show a worker lost and its host coming back after the cooldown.
# On a cluster, ask its scheduler or cloud API instead.
if [ -n "$ELASTIC_HOSTS_FILE" ]; then
    cat "$ELASTIC_HOSTS_FILE"
else
    echo "localhost:1"
    echo "127.0.0.1:1"
fi
