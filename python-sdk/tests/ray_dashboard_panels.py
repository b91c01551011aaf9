"""PromQL of Ray 2.60's default Grafana dashboard, copied from the Ray 2.60 package
(``ray/dashboard/modules/metrics/dashboards/default_dashboard_panels.py``; the
``standard_global_filters`` of its ``default_dashboard_config``), for
``test_metrics.py``: a real Prometheus scraping a tpuray cluster must return data for
these panels' queries.

Each entry: (panel id, title, [(target expression as Ray writes it, must return data)]).
``{global_filters}`` is filled as Ray's ``grafana_dashboard_factory._generate_targets``
fills it, then Grafana's variables as an "All" selection sets them (``$SessionName``:
the cluster's session, ``$Instance``: ``.+``, ``$Cluster``: ``.*``, ``$RayNodeType``:
``(head|worker)``).

Targets not expected to return data, and why: the GPU ones (the cluster has no GPUs),
``autoscaler_*`` (tpuray has no autoscaler metrics), the cgroup memory ones (only in a
container with a memory limit); the constant ``100`` lines return data trivially.
Panels left out entirely: Node Count (autoscaler), Ray OOM Kills and Unexpected System
Level Worker Failures (tpuray has no memory monitor metrics), the GPU panels, and the
TPU utilisation panels (they need libtpu's runtime metrics, which simulated hosts lack).
"""

# ruff: noqa: E501

STANDARD_GLOBAL_FILTERS = ["SessionName=~\"$SessionName\"", "ray_io_cluster=~\"$Cluster\""]

PANELS = [
    (26, 'All Tasks by State', [
        ('sum(max_over_time(ray_tasks{{IsRetry="0",State=~"FINISHED|FAILED",instance=~"$Instance",{global_filters}}}[14d])) by (State) or clamp_min(sum(ray_tasks{{IsRetry="0",State!~"FINISHED|FAILED",instance=~"$Instance",{global_filters}}}) by (State), 0)', True),
        ('sum(max_over_time(ray_tasks{{IsRetry!="0",State=~"FINISHED|FAILED",instance=~"$Instance",{global_filters}}}[14d])) by (State) or clamp_min(sum(ray_tasks{{IsRetry!="0",State!~"FINISHED|FAILED",instance=~"$Instance",{global_filters}}}) by (State), 0)', True),
    ]),
    (35, 'Active Tasks by Name', [
        ('clamp_min(sum(ray_tasks{{IsRetry="0",State!~"FINISHED|FAILED",instance=~"$Instance",{global_filters}}}) by (Name), 0)', True),
        ('clamp_min(sum(ray_tasks{{IsRetry!="0",State!~"FINISHED|FAILED",instance=~"$Instance",{global_filters}}}) by (Name), 0)', True),
    ]),
    (38, 'Running Tasks by Name', [
        ('clamp_min(sum(ray_tasks{{IsRetry="0",State=~"RUNNING*",instance=~"$Instance",{global_filters}}}) by (Name), 0)', True),
        ('clamp_min(sum(ray_tasks{{IsRetry!="0",State=~"RUNNING*",instance=~"$Instance",{global_filters}}}) by (Name), 0)', True),
    ]),
    (64, 'Running Tasks by Node', [
        ('clamp_min(sum(ray_tasks{{State=~"RUNNING*",Source="executor",instance=~"$Instance",{global_filters}}}) by (instance), 0)', True),
    ]),
    (33, 'All Actors by State', [
        ('sum(ray_actors{{Source="gcs",{global_filters}}}) by (State)', True),
    ]),
    (42, 'Alive Actors by State', [
        ('sum(ray_actors{{Source="executor",NodeAddress=~"$Instance",{global_filters}}}) by (State)', True),
    ]),
    (36, 'Alive Actors by Name', [
        ('sum(ray_actors{{State!="DEAD",Source="executor",NodeAddress=~"$Instance",{global_filters}}}) by (Name)', True),
    ]),
    (40, 'All Placement Groups by State', [
        ('sum(ray_placement_groups{{{global_filters}}}) by (State)', True),
    ]),
    (29, 'Object Store Memory by Location', [
        ('sum(ray_object_store_memory{{instance=~"$Instance",{global_filters}}}) by (Location)', True),
        ('sum(ray_resources{{Name="object_store_memory",instance=~"$Instance",{global_filters}}})', True),
    ]),
    (27, 'Logical CPUs Usage', [
        ('sum(ray_resources{{Name="CPU",State="USED",instance=~"$Instance",{global_filters}}}) by (instance)', True),
        ('sum(ray_resources{{Name="CPU",instance=~"$Instance",{global_filters}}})', True),
        ('((sum(autoscaler_cluster_resources{{resource="CPU",{global_filters}}}) or vector(0)) + (sum(autoscaler_pending_resources{{resource="CPU",{global_filters}}}) or vector(0)) and (sum(autoscaler_cluster_resources{{resource="CPU",{global_filters}}}) or vector(0)) + (sum(autoscaler_pending_resources{{resource="CPU",{global_filters}}}) or vector(0)) > (sum(autoscaler_cluster_resources{{resource="CPU",{global_filters}}}) or vector(0)))', False),
    ]),
    (61, 'Logical Memory Usage', [
        ('sum(ray_resources{{Name="memory",State="USED",instance=~"$Instance",{global_filters}}}) by (instance)', True),
        ('sum(ray_resources{{Name="memory",instance=~"$Instance",{global_filters}}})', True),
        ('((sum(autoscaler_cluster_resources{{resource="memory",{global_filters}}}) or vector(0)) + (sum(autoscaler_pending_resources{{resource="memory",{global_filters}}}) or vector(0)) and (sum(autoscaler_cluster_resources{{resource="memory",{global_filters}}}) or vector(0)) + (sum(autoscaler_pending_resources{{resource="memory",{global_filters}}}) or vector(0)) > (sum(autoscaler_cluster_resources{{resource="memory",{global_filters}}}) or vector(0)))', False),
    ]),
    (58, 'Object Store Memory Usage', [
        ('sum(ray_object_store_memory{{instance=~"$Instance",{global_filters}}}) by (instance)', True),
        ('sum(ray_resources{{Name="object_store_memory",instance=~"$Instance",{global_filters}}})', True),
    ]),
    (59, 'Object Store Memory Usage %', [
        ('sum(ray_object_store_memory{{instance=~"$Instance",{global_filters}}}) by (instance) * 100 / sum(ray_resources{{Name="object_store_memory",instance=~"$Instance",{global_filters}}}) by (instance)', True),
        ('100', True),
    ]),
    (60, 'Object Store Memory Spilled to Disk', [
        ('sum(ray_object_store_memory{{instance=~"$Instance",Location="SPILLED",{global_filters}}}) by (instance)', True),
    ]),
    (41, 'Cluster Utilization', [
        ('avg(ray_node_cpu_utilization{{instance=~"$Instance",{global_filters}}})', True),
        ('sum(ray_node_gpus_utilization{{instance=~"$Instance",{global_filters}}}) / on() (sum(ray_node_gpus_available{{instance=~"$Instance",{global_filters}}}) or vector(0))', False),
        ('sum(ray_node_mem_used_host{{instance=~"$Instance",{global_filters}}}) / on() (sum(ray_node_mem_total_host{{instance=~"$Instance",{global_filters}}})) * 100', True),
        ('sum(ray_node_gram_used{{instance=~"$Instance",{global_filters}}}) / on() (sum(ray_node_gram_available{{instance=~"$Instance",{global_filters}}}) + sum(ray_node_gram_used{{instance=~"$Instance",{global_filters}}})) * 100', False),
        ('sum(ray_object_store_memory{{instance=~"$Instance",{global_filters}}}) / on() sum(ray_resources{{Name="object_store_memory",instance=~"$Instance",{global_filters}}}) * 100', True),
        ('sum(ray_node_disk_usage{{instance=~"$Instance",{global_filters}}}) / on() (sum(ray_node_disk_free{{instance=~"$Instance",{global_filters}}}) + sum(ray_node_disk_usage{{instance=~"$Instance",{global_filters}}})) * 100', True),
    ]),
    (37, 'Node CPU Usage by Component', [
        ('sum(ray_component_cpu_percentage{{instance=~"$Instance",{global_filters}}}) by (Component) / 100', True),
        ('sum(ray_node_cpu_count{{instance=~"$Instance",{global_filters}}})', True),
    ]),
    (34, 'Node Memory Usage by Component', [
        ('(sum(ray_component_rss_bytes{{instance=~"$Instance",{global_filters}}}) by (Component)) - (sum(ray_component_shared_bytes{{instance=~"$Instance",{global_filters}}}) by (Component))', True),
        ('sum(ray_node_mem_shared_bytes{{instance=~"$Instance",{global_filters}}})', True),
        ('min(label_replace(sum(ray_node_mem_total_host{{instance=~"$Instance",{global_filters}}}), "mem_cap_source", "host", "", "") or label_replace(sum(ray_node_cgroup_mem_total{{instance=~"$Instance",{global_filters}}}), "mem_cap_source", "cgroup", "", ""))', True),
    ]),
    (2, 'Node CPU Usage', [
        ('sum(ray_node_cpu_utilization{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}} * ray_node_cpu_count{{instance=~"$Instance", RayNodeType=~"$RayNodeType",{global_filters}}} / 100) by (instance, RayNodeType)', True),
        ('sum(ray_node_cpu_count{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}})', True),
    ]),
    (54, 'Node CPU Usage %', [
        ('sum(ray_node_cpu_utilization{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', True),
    ]),
    (4, 'Node Memory Usage (heap + object store)', [
        ('sum(ray_node_mem_used_host{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', True),
        ('sum(ray_node_mem_total_host{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}})', True),
        ('sum(ray_node_cgroup_mem_used{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', False),
        ('sum(ray_node_cgroup_mem_total{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}})', False),
    ]),
    (48, 'Node Memory Usage % (heap + object store)', [
        ('sum(ray_node_mem_used_host{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType) * 100 / sum(ray_node_mem_total_host{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', True),
        ('sum(ray_node_cgroup_mem_used{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType) * 100 / sum(ray_node_cgroup_mem_total{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', False),
    ]),
    (6, 'Node Disk Usage', [
        ('sum(ray_node_disk_usage{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', True),
        ('sum(ray_node_disk_free{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) + sum(ray_node_disk_usage{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}})', True),
    ]),
    (57, 'Node Disk Usage %', [
        ('sum(ray_node_disk_usage{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType) * 100 / (sum(ray_node_disk_free{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType) + sum(ray_node_disk_usage{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType))', True),
    ]),
    (32, 'Node Disk IO Speed', [
        ('sum(ray_node_disk_io_write_speed{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', True),
        ('sum(ray_node_disk_io_read_speed{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', True),
    ]),
    (20, 'Node Network', [
        ('sum(ray_node_network_receive_speed{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', True),
        ('sum(ray_node_network_send_speed{{instance=~"$Instance", RayNodeType=~"$RayNodeType", {global_filters}}}) by (instance, RayNodeType)', True),
    ]),
]
