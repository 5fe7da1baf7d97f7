{{/*
The chart name, truncated to 63 characters (a DNS label).
*/}}
{{- define "tokenmill.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of the release's resources: fullnameOverride, or <release>-<chart> unless the release
name already contains the chart name.
*/}}
{{- define "tokenmill.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tokenmill.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenmill.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenmill.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tokenmill.labels" -}}
helm.sh/chart: {{ include "tokenmill.chart" . }}
{{ include "tokenmill.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: server
app.kubernetes.io/part-of: tokenmill
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tokenmill.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tokenmill.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference: repository:tag, the tag defaulting to the appVersion, with gpuTagSuffix
appended when gpu > 0 (the CUDA variant of the Dockerfile).
*/}}
{{- define "tokenmill.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag | toString }}
{{- if and (gt (int .Values.gpu) 0) .Values.image.gpuTagSuffix (not (hasSuffix .Values.image.gpuTagSuffix $tag)) }}
{{- $tag = printf "%s%s" $tag .Values.image.gpuTagSuffix }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/*
The device: server.device, or cuda when gpu > 0, else cpu.
*/}}
{{- define "tokenmill.device" -}}
{{- if .Values.server.device }}
{{- .Values.server.device }}
{{- else if gt (int .Values.gpu) 0 }}
{{- "cuda" }}
{{- else }}
{{- "cpu" }}
{{- end }}
{{- end }}

{{/*
The dtype: server.dtype, or auto (the server picks bfloat16 where the CPU or GPU runs it natively).
*/}}
{{- define "tokenmill.dtype" -}}
{{- default "auto" .Values.server.dtype }}
{{- end }}

{{/*
Worker processes: server.workers, or gpu / tensorParallel model replicas when gpu > 0, else 1.
*/}}
{{- define "tokenmill.workers" -}}
{{- $workers := int .Values.server.workers }}
{{- if and .Values.leaderWorkerSet.enabled (gt (int .Values.leaderWorkerSet.size) 1) }}
{{- 1 }}
{{- else if gt $workers 0 }}
{{- $workers }}
{{- else if gt (int .Values.gpu) 0 }}
{{- max 1 (div (int .Values.gpu) (int .Values.tensorParallel)) }}
{{- else }}
{{- 1 }}
{{- end }}
{{- end }}

{{/*
The path passed as --model (TOKENMILL_MODEL); empty = the server's embedded default.
*/}}
{{- define "tokenmill.modelPath" -}}
{{- if eq .Values.model.source "embedded" }}
{{- .Values.model.path }}
{{- else if .Values.model.file }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.file) }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/*
terminationGracePeriodSeconds: the explicit value, or server.drainSeconds + the margin.
*/}}
{{- define "tokenmill.terminationGracePeriodSeconds" -}}
{{- if not (kindIs "invalid" .Values.terminationGracePeriodSeconds) }}
{{- int .Values.terminationGracePeriodSeconds }}
{{- else }}
{{- add (int .Values.server.drainSeconds) (int .Values.terminationGracePeriodMarginSeconds) }}
{{- end }}
{{- end }}

{{/*
Checks of combinations the schema cannot express; fails the render with a message.
*/}}
{{- define "tokenmill.validate" -}}
{{- $gpu := int .Values.gpu }}
{{- $tp := int .Values.tensorParallel }}
{{- $device := include "tokenmill.device" . }}
{{- /* gpu below workers x tensorParallel still renders (NOTES warns; the server refuses to start
     with a message naming both numbers): the cluster, not the chart, knows the node's devices. */}}
{{- if and (eq $device "cuda") (eq $gpu 0) }}
{{- fail "server.device cuda needs gpu > 0" }}
{{- end }}
{{- if and (eq $device "cpu") (gt $gpu 0) }}
{{- fail "gpu > 0 with server.device cpu would request GPUs that are never used" }}
{{- end }}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.source pvc needs model.pvc.claimName (an existing PersistentVolumeClaim)" }}
{{- end }}
{{- if and (eq .Values.model.source "hostPath") (not .Values.model.hostPath.path) }}
{{- fail "model.source hostPath needs model.hostPath.path" }}
{{- end }}
{{- $grace := int (include "tokenmill.terminationGracePeriodSeconds" .) }}
{{- if le $grace (int .Values.server.drainSeconds) }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be greater than server.drainSeconds (%d), or in-flight calls are killed mid-drain" $grace (int .Values.server.drainSeconds)) }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (eq (int .Values.server.metricsPort) 0) }}
{{- fail "serviceMonitor.enabled needs server.metricsPort > 0" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas)) }}
{{- fail "autoscaling.maxReplicas must be >= autoscaling.minReplicas" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (not (dig "requests" "cpu" "" (.Values.resources | default dict))) }}
{{- fail "autoscaling on CPU utilisation needs resources.requests.cpu" }}
{{- end }}
{{- if and .Values.podDisruptionBudget.enabled (not (kindIs "invalid" .Values.podDisruptionBudget.maxUnavailable)) (not (kindIs "invalid" .Values.podDisruptionBudget.minAvailable)) }}
{{- fail "set only one of podDisruptionBudget.maxUnavailable and podDisruptionBudget.minAvailable" }}
{{- end }}
{{- if and .Values.autoscaling.enabled .Values.keda.enabled }}
{{- fail "set only one of autoscaling.enabled (an HPA on CPU) and keda.enabled (KEDA on queue depth): both would scale the same pods" }}
{{- end }}
{{- if and .Values.keda.enabled (lt (int .Values.keda.maxReplicas) (int .Values.keda.minReplicas)) }}
{{- fail "keda.maxReplicas must be >= keda.minReplicas" }}
{{- end }}
{{- if and .Values.keda.enabled (not .Values.keda.prometheus.serverAddress) }}
{{- fail "keda.enabled needs keda.prometheus.serverAddress (the Prometheus that scrapes the pods)" }}
{{- end }}
{{- if and .Values.inferencePool.enabled (eq (int .Values.server.httpPort) 0) }}
{{- fail "inferencePool.enabled needs server.httpPort > 0: the gateway sends OpenAI-compatible HTTP requests and the endpoint picker scrapes /metrics there" }}
{{- end }}
{{- $size := int .Values.leaderWorkerSet.size }}
{{- if and .Values.leaderWorkerSet.enabled (gt $size 1) }}
{{- if lt (int .Values.tensorParallel) $size }}
{{- fail (printf "leaderWorkerSet.size %d spreads one replica's tensorParallel ranks over the group's pods: tensorParallel must be at least %d" $size $size) }}
{{- end }}
{{- if gt (int .Values.server.workers) 1 }}
{{- fail "leaderWorkerSet.size above 1 serves one replica spanning the group's pods: server.workers must be 0 or 1" }}
{{- end }}
{{- if and (gt $gpu 0) (ne (mod (int .Values.tensorParallel) $size) 0) }}
{{- fail "with GPUs, leaderWorkerSet.size must divide tensorParallel (each pod runs tensorParallel / size ranks, one GPU each)" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
What an autoscaler scales: the Deployment, or the LeaderWorkerSet (which has a scale subresource).
*/}}
{{- define "tokenmill.scaleTarget" -}}
{{- if .Values.leaderWorkerSet.enabled -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else -}}
apiVersion: apps/v1
kind: Deployment
{{- end }}
name: {{ include "tokenmill.fullname" . }}
{{- end }}

{{/*
KEDA's load query: keda.prometheus.query, else the requests waiting summed over the release's pods.
*/}}
{{- define "tokenmill.kedaQuery" -}}
{{- if .Values.keda.prometheus.query -}}
{{- .Values.keda.prometheus.query }}
{{- else -}}
{{- printf "sum(tokenmill_queue_size{namespace=\"%s\", service=\"%s\"})" .Release.Namespace (include "tokenmill.fullname" .) }}
{{- end }}
{{- end }}

{{/*
GPUs the pod requests: one per rank of every replica (workers x tensorParallel); 0 on CPU.
*/}}
{{- define "tokenmill.gpuRequest" -}}
{{- if and (gt (int .Values.gpu) 0) .Values.leaderWorkerSet.enabled (gt (int .Values.leaderWorkerSet.size) 1) }}
{{- div (int .Values.tensorParallel) (int .Values.leaderWorkerSet.size) }}
{{- else if gt (int .Values.gpu) 0 }}
{{- mul (int (include "tokenmill.workers" .)) (int .Values.tensorParallel) }}
{{- else }}
{{- 0 }}
{{- end }}
{{- end }}

{{/*
Size of /dev/shm: shm.sizeLimit, or 1Gi per GPU rank (NCCL's intra-node buffers live there), at least 2Gi.
*/}}
{{- define "tokenmill.shmSize" -}}
{{- if .Values.shm.sizeLimit }}
{{- .Values.shm.sizeLimit }}
{{- else }}
{{- max 2 (int (include "tokenmill.gpuRequest" .)) }}Gi
{{- end }}
{{- end }}

{{/*
A note when the pod requests another number of GPUs than gpu says (it requests what its replicas use).
*/}}
{{- define "tokenmill.gpuWarning" -}}
{{- $gpu := int .Values.gpu }}
{{- $request := int (include "tokenmill.gpuRequest" .) }}
{{- if and (gt $gpu 0) (ne $request $gpu) }}
NOTE: {{ include "tokenmill.workers" . }} replica(s) x tensorParallel {{ .Values.tensorParallel }} use {{ $request }} GPUs: the pod requests {{ $request }}, not gpu={{ $gpu }}. Set gpu to a multiple of tensorParallel (or server.workers) to make them agree.
{{- end }}
{{- end }}
