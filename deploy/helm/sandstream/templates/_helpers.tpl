{{/* Names and labels. */}}
{{- define "sandstream.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sandstream.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "sandstream.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "sandstream.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "sandstream.sandboxNamespace" -}}
{{- .Values.kubernetesDriver.namespace | default .Release.Namespace -}}
{{- end -}}

{{- define "sandstream.serviceAccount" -}}
{{- .Values.kubernetesDriver.serviceAccountName | default (include "sandstream.fullname" .) -}}
{{- end -}}

{{/*
The settings every role shares, as SANDSTREAM_* variables, and the secrets of its Kafka
principal: {{ include "sandstream.env" (dict "root" $ "principal" "processor" "key" true) }}.
"key" adds the credentials key (the API, the executor and provider sync decrypt or encrypt
provider values).
*/}}
{{- define "sandstream.env" -}}
{{- $v := .root.Values -}}
- name: SANDSTREAM_KAFKA_BOOTSTRAP
  value: {{ required "kafka.bootstrap is required" $v.kafka.bootstrap | quote }}
- name: SANDSTREAM_KAFKA_SECURITY_PROTOCOL
  value: {{ $v.kafka.securityProtocol | quote }}
- name: SANDSTREAM_KAFKA_SASL_MECHANISM
  value: {{ $v.kafka.saslMechanism | quote }}
- name: SANDSTREAM_KAFKA_PARTITIONS
  value: {{ $v.kafka.partitions | quote }}
- name: SANDSTREAM_TOPIC_COMMANDS
  value: {{ $v.kafka.topics.commands | quote }}
- name: SANDSTREAM_TOPIC_OBSERVATIONS
  value: {{ $v.kafka.topics.observations | quote }}
- name: SANDSTREAM_TOPIC_EVENTS
  value: {{ $v.kafka.topics.events | quote }}
- name: SANDSTREAM_TOPIC_DEADLETTER
  value: {{ $v.kafka.topics.deadletter | quote }}
- name: SANDSTREAM_PROCESSOR_GROUP
  value: {{ $v.kafka.groups.processor | quote }}
- name: SANDSTREAM_EXECUTOR_GROUP
  value: {{ $v.kafka.groups.executor | quote }}
{{- if $v.kafka.caConfigMap }}
- name: SANDSTREAM_KAFKA_SSL_CAFILE
  value: /etc/sandstream/kafka-ca/ca.crt
{{- end }}
- name: SANDSTREAM_KAFKA_CREDENTIALS
  valueFrom:
    secretKeyRef:
      name: {{ $v.kafka.credentialsSecret | quote }}
      key: {{ .principal | quote }}
- name: SANDSTREAM_PG_HOST
  value: {{ required "postgres.host is required" $v.postgres.host | quote }}
- name: SANDSTREAM_PG_PORT
  value: {{ $v.postgres.port | quote }}
- name: SANDSTREAM_PG_DATABASE
  value: {{ $v.postgres.database | quote }}
- name: SANDSTREAM_PG_USER
  value: {{ $v.postgres.user | quote }}
- name: SANDSTREAM_PG_SCHEMA
  value: {{ $v.postgres.schema | quote }}
- name: SANDSTREAM_PG_SSLMODE
  value: {{ $v.postgres.sslmode | quote }}
{{- if $v.postgres.caConfigMap }}
- name: SANDSTREAM_PG_SSLROOTCERT
  value: /etc/sandstream/postgres-ca/ca.crt
{{- end }}
- name: SANDSTREAM_PG_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $v.postgres.passwordSecret.name | quote }}
      key: {{ $v.postgres.passwordSecret.key | quote }}
{{- if .key }}
- name: SANDSTREAM_CREDENTIALS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.credentialsKeySecret.name | quote }}
      key: {{ $v.credentialsKeySecret.key | quote }}
{{- end }}
- name: SANDSTREAM_RUN_DIR
  value: /run/sandstream
- name: SANDSTREAM_DRIVER
  value: {{ $v.driver | quote }}
{{- if eq $v.driver "kubernetes" }}
- name: SANDSTREAM_KUBE_NAMESPACE
  value: {{ include "sandstream.sandboxNamespace" .root | quote }}
- name: SANDSTREAM_KUBE_IMAGE_PULL_POLICY
  value: {{ $v.kubernetesDriver.imagePullPolicy | quote }}
{{- if $v.kubernetesDriver.storageClass }}
- name: SANDSTREAM_KUBE_STORAGE_CLASS
  value: {{ $v.kubernetesDriver.storageClass | quote }}
{{- end }}
{{- end }}
{{- if eq $v.driver "podman" }}
- name: SANDSTREAM_PODMAN_SOCKET
  value: /run/podman/podman.sock
{{- end }}
{{- range $name, $value := $v.settings }}
- name: SANDSTREAM_{{ $name | upper }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}

{{/* The volumes every role mounts: the tokens file's private copy, scratch space, CAs. */}}
{{- define "sandstream.volumes" -}}
- name: run
  emptyDir:
    medium: Memory
    sizeLimit: 4Mi
- name: state
  emptyDir:
    sizeLimit: 64Mi
- name: tmp
  emptyDir:
    sizeLimit: 256Mi
{{- if .Values.kafka.caConfigMap }}
- name: kafka-ca
  configMap:
    name: {{ .Values.kafka.caConfigMap | quote }}
{{- end }}
{{- if .Values.postgres.caConfigMap }}
- name: postgres-ca
  configMap:
    name: {{ .Values.postgres.caConfigMap | quote }}
{{- end }}
{{- end -}}

{{- define "sandstream.volumeMounts" -}}
- name: run
  mountPath: /run/sandstream
- name: state
  mountPath: /var/lib/sandstream
- name: tmp
  mountPath: /tmp
{{- if .Values.kafka.caConfigMap }}
- name: kafka-ca
  mountPath: /etc/sandstream/kafka-ca
  readOnly: true
{{- end }}
{{- if .Values.postgres.caConfigMap }}
- name: postgres-ca
  mountPath: /etc/sandstream/postgres-ca
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The tokens file from its Secret, written with mode 0600 into the pod's memory-backed run
directory: sandstream refuses a tokens file others can read, and a Secret volume's files are
group-readable under an fsGroup (so it travels as an environment variable of this step only).
*/}}
{{- define "sandstream.tokensInit" -}}
{{- $v := .Values -}}
- name: tokens
  image: {{ include "sandstream.image" . }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["sh", "-c", "umask 077 && printf '%s' \"$TOKENS\" > /run/sandstream/tokens.json"]
  env:
    - name: TOKENS
      valueFrom:
        secretKeyRef:
          name: {{ $v.tokensSecret.name | quote }}
          key: {{ $v.tokensSecret.key | quote }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 64Mi}
  volumeMounts:
    - name: run
      mountPath: /run/sandstream
{{- end -}}

{{/* The scheduling values every pod of the chart shares. */}}
{{- define "sandstream.placement" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The Kubernetes API's address for a pod that uses the driver's token, when
kubernetesDriver.apiServer.host overrides the one the kubelet injects.
*/}}
{{- define "sandstream.apiServerEnv" -}}
{{- with .Values.kubernetesDriver.apiServer }}
{{- if .host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ .host | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .port | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The API's certificate and key from the api.tls.secretName Secret (kubernetes.io/tls), written
like the tokens file into the run directory, the key with mode 0600: sandstream refuses a key
file others can read, and a Secret volume's files are group-readable under an fsGroup. A
renewed certificate takes effect when the pods restart.
*/}}
{{- define "sandstream.tlsInit" -}}
{{- $v := .Values -}}
- name: tls
  image: {{ include "sandstream.image" . }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["sh", "-c", "umask 077 && printf '%s' \"$CERT\" > /run/sandstream/tls.crt && printf '%s' \"$KEY\" > /run/sandstream/tls.key"]
  env:
    - name: CERT
      valueFrom:
        secretKeyRef:
          name: {{ $v.api.tls.secretName | quote }}
          key: tls.crt
    - name: KEY
      valueFrom:
        secretKeyRef:
          name: {{ $v.api.tls.secretName | quote }}
          key: tls.key
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 64Mi}
  volumeMounts:
    - name: run
      mountPath: /run/sandstream
{{- end -}}

{{- define "sandstream.tlsEnv" -}}
- name: SANDSTREAM_API_TLS_CERTFILE
  value: /run/sandstream/tls.crt
- name: SANDSTREAM_API_TLS_KEYFILE
  value: /run/sandstream/tls.key
{{- end -}}

{{- define "sandstream.probes" -}}
startupProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
  periodSeconds: 2
  failureThreshold: 60
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ .port }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 3
{{- end -}}
