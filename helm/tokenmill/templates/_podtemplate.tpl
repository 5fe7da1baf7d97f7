{{/*
The pod template of the server (a Deployment's, or a LeaderWorkerSet group's): metadata and spec,
at the left margin; callers nindent it.
*/}}
{{- define "tokenmill.podTemplate" -}}
{{- $gpu := int .Values.gpu }}
{{- $modelPath := include "tokenmill.modelPath" . }}
{{- $metricsPort := int .Values.server.metricsPort }}
{{- $probePort := ternary (int .Values.server.tls.healthPort) (int .Values.server.port) (ne .Values.server.tls.secretName "") -}}
metadata:
  labels:
    {{- include "tokenmill.labels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or .Values.podAnnotations .Values.server.chatTemplate }}
  annotations:
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- if .Values.server.chatTemplate }}
    # The server reads the template at start: a changed one rolls the pods.
    checksum/chat-template: {{ sha256sum .Values.server.chatTemplate | quote }}
    {{- end }}
  {{- end }}
spec:
  serviceAccountName: {{ include "tokenmill.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automount }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  # Above server.drainSeconds: SIGTERM lets in-flight calls finish, then the server exits 0.
  terminationGracePeriodSeconds: {{ include "tokenmill.terminationGracePeriodSeconds" . }}
  {{- with .Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: tokenmill
      image: {{ include "tokenmill.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      {{- with .Values.server.extraArgs }}
      args:
        {{- range . }}
        - {{ toString . | quote }}
        {{- end }}
      {{- end }}
      env:
        - name: TOKENMILL_HOST
          value: {{ .Values.server.host | quote }}
        - name: TOKENMILL_PORT
          value: {{ int .Values.server.port | quote }}
        {{- if $modelPath }}
        - name: TOKENMILL_MODEL
          value: {{ $modelPath | quote }}
        {{- end }}
        - name: TOKENMILL_DEVICE
          value: {{ include "tokenmill.device" . | quote }}
        - name: TOKENMILL_WORKERS
          value: {{ include "tokenmill.workers" . | quote }}
        - name: TOKENMILL_TENSOR_PARALLEL
          value: {{ int .Values.tensorParallel | quote }}
        - name: TOKENMILL_BACKEND
          value: {{ .Values.server.backend | quote }}
        - name: TOKENMILL_DTYPE
          value: {{ include "tokenmill.dtype" . | quote }}
        - name: TOKENMILL_QUANTIZATION
          value: {{ .Values.server.quantization | quote }}
        - name: TOKENMILL_KV_CACHE_DTYPE
          value: {{ .Values.server.kvCacheDtype | quote }}
        - name: TOKENMILL_CPU_ISA
          value: {{ .Values.server.cpuIsa | quote }}
        - name: TOKENMILL_COMPILE
          value: {{ .Values.server.compile | quote }}
        - name: TOKENMILL_SPECULATIVE_TOKENS
          value: {{ int .Values.server.speculativeTokens | quote }}
        - name: TOKENMILL_MAX_QUEUE
          value: {{ int .Values.server.maxQueue | quote }}
        - name: TOKENMILL_MAX_BATCH_SIZE
          value: {{ int .Values.server.maxBatchSize | quote }}
        - name: TOKENMILL_MAX_BATCH_TOKENS
          value: {{ int .Values.server.maxBatchTokens | quote }}
        - name: TOKENMILL_MAX_NEW_TOKENS_LIMIT
          value: {{ int .Values.server.maxNewTokens | quote }}
        - name: TOKENMILL_MAX_MODEL_LEN
          value: {{ int .Values.server.maxModelLen | quote }}
        {{- with .Values.server.servedModelName }}
        - name: TOKENMILL_SERVED_MODEL_NAME
          value: {{ . | quote }}
        {{- end }}
        {{- if .Values.server.chatTemplate }}
        - name: TOKENMILL_CHAT_TEMPLATE
          value: /etc/tokenmill/chat-template/chat_template.jinja
        {{- end }}
        {{- with .Values.server.kvCacheMemory }}
        - name: TOKENMILL_KV_CACHE_MEMORY
          value: {{ toString . | quote }}
        {{- end }}
        - name: TOKENMILL_LOG_FORMAT
          value: {{ .Values.server.logFormat | quote }}
        - name: TOKENMILL_LOG_LEVEL
          value: {{ .Values.server.logLevel | quote }}
        - name: TOKENMILL_DRAIN_SECONDS
          value: {{ int .Values.server.drainSeconds | quote }}
        - name: TOKENMILL_METRICS_PORT
          value: {{ $metricsPort | quote }}
        - name: TOKENMILL_HTTP_PORT
          value: {{ int .Values.server.httpPort | quote }}
        - name: TOKENMILL_METRICS_WITHOUT_AUTH
          value: {{ .Values.server.metricsWithoutAuth | quote }}
        {{- with .Values.server.authTokenSecret }}
        {{- if .name }}
        - name: TOKENMILL_AUTH_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ .name }}
              key: {{ .key }}
        {{- end }}
        {{- end }}
        {{- with .Values.server.tls }}
        {{- if .secretName }}
        - name: TOKENMILL_TLS_CERT
          value: /etc/tokenmill/tls/tls.crt
        - name: TOKENMILL_TLS_KEY
          value: /etc/tokenmill/tls/tls.key
        {{- if .requireClientCert }}
        - name: TOKENMILL_TLS_CLIENT_CA
          value: /etc/tokenmill/tls/ca.crt
        {{- end }}
        - name: TOKENMILL_HEALTH_PORT
          value: {{ int .healthPort | quote }}
        {{- end }}
        {{- end }}
        # The root filesystem is read-only: HOME and the compiler caches live on the /tmp emptyDir.
        - name: HOME
          value: /tmp
        - name: XDG_CACHE_HOME
          value: /tmp/.cache
        - name: TRITON_CACHE_DIR
          value: /tmp/.cache/triton
        - name: TORCHINDUCTOR_CACHE_DIR
          value: /tmp/.cache/torchinductor
        {{- range .Values.server.extraEnv }}
        {{- $item := deepCopy . }}
        {{- if hasKey $item "value" }}
        {{- $_ := set $item "value" (toString $item.value) }}
        {{- end }}
        {{- toYaml (list $item) | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ int .Values.server.port }}
          protocol: TCP
        {{- if gt $metricsPort 0 }}
        - name: metrics
          containerPort: {{ $metricsPort }}
          protocol: TCP
        {{- end }}
        {{- if gt (int .Values.server.httpPort) 0 }}
        - name: http
          containerPort: {{ int .Values.server.httpPort }}
          protocol: TCP
        {{- end }}
      {{- with .Values.probes.startup }}
      {{- if .enabled }}
      # Model load and warm-up: the health service says NOT_SERVING until then.
      startupProbe:
        grpc:
          port: {{ $probePort }}
          {{- with .service }}
          service: {{ . | quote }}
          {{- end }}
        initialDelaySeconds: {{ .initialDelaySeconds }}
        periodSeconds: {{ .periodSeconds }}
        timeoutSeconds: {{ .timeoutSeconds }}
        failureThreshold: {{ .failureThreshold }}
      {{- end }}
      {{- end }}
      {{- with .Values.probes.readiness }}
      {{- if .enabled }}
      readinessProbe:
        grpc:
          port: {{ $probePort }}
          {{- with .service }}
          service: {{ . | quote }}
          {{- end }}
        periodSeconds: {{ .periodSeconds }}
        timeoutSeconds: {{ .timeoutSeconds }}
        failureThreshold: {{ .failureThreshold }}
        successThreshold: {{ .successThreshold }}
      {{- end }}
      {{- end }}
      {{- with .Values.probes.liveness }}
      {{- if .enabled }}
      livenessProbe:
        grpc:
          port: {{ $probePort }}
          {{- with .service }}
          service: {{ . | quote }}
          {{- end }}
        periodSeconds: {{ .periodSeconds }}
        timeoutSeconds: {{ .timeoutSeconds }}
        failureThreshold: {{ .failureThreshold }}
      {{- end }}
      {{- end }}
      {{- $resources := deepCopy (.Values.resources | default dict) }}
      {{- if gt $gpu 0 }}
      {{- $limits := get $resources "limits" | default dict }}
      {{- $_ := set $limits "nvidia.com/gpu" (int (include "tokenmill.gpuRequest" .)) }}
      {{- $_ := set $resources "limits" $limits }}
      {{- end }}
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- if .Values.server.tls.secretName }}
        - name: tls
          mountPath: /etc/tokenmill/tls
          readOnly: true
        {{- end }}
        {{- if .Values.server.chatTemplate }}
        - name: chat-template
          mountPath: /etc/tokenmill/chat-template
          readOnly: true
        {{- end }}
        - name: dshm
          mountPath: /dev/shm
        {{- if ne .Values.model.source "embedded" }}
        - name: model
          mountPath: {{ .Values.model.mountPath }}
          readOnly: true
          {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
          subPath: {{ .Values.model.pvc.subPath }}
          {{- end }}
        {{- end }}
  volumes:
    {{- if .Values.server.tls.secretName }}
    - name: tls
      secret:
        secretName: {{ .Values.server.tls.secretName }}
    {{- end }}
    {{- if .Values.server.chatTemplate }}
    - name: chat-template
      configMap:
        name: {{ include "tokenmill.fullname" . }}-chat-template
    {{- end }}
    - name: tmp
      emptyDir:
        {{- with .Values.tmp.sizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    # Shared memory for NCCL and torch multiprocessing (the container default is 64Mi).
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ include "tokenmill.shmSize" . }}
    {{- if eq .Values.model.source "pvc" }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ .Values.model.pvc.claimName }}
        readOnly: true
    {{- else if eq .Values.model.source "hostPath" }}
    - name: model
      hostPath:
        path: {{ .Values.model.hostPath.path }}
        {{- with .Values.model.hostPath.type }}
        type: {{ . }}
        {{- end }}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
