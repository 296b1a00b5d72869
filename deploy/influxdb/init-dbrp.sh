#!/bin/sh
# Runs once, when the influxdb:2 container sets itself up (docker-entrypoint-initdb.d): map the
# InfluxQL database "$DOCKER_INFLUXDB_INIT_BUCKET" (retention policy autogen) to the bucket of the
# same name, so that Grafana's InfluxQL queries and 1.x-style clients find the sink's data.
set -eu
bucket_id=$(influx bucket list --name "$DOCKER_INFLUXDB_INIT_BUCKET" --org "$DOCKER_INFLUXDB_INIT_ORG" \
  --token "$DOCKER_INFLUXDB_INIT_ADMIN_TOKEN" --hide-headers | cut -f1)
influx v1 dbrp create --bucket-id "$bucket_id" --db "$DOCKER_INFLUXDB_INIT_BUCKET" --rp autogen --default \
  --org "$DOCKER_INFLUXDB_INIT_ORG" --token "$DOCKER_INFLUXDB_INIT_ADMIN_TOKEN"
