{{/*
Names, labels and the few values derived in more than one template.
*/}}

{{- define "statestore-async.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "statestore-async.fullname" -}}
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

{{- define "statestore-async.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "statestore-async.selectorLabels" -}}
app.kubernetes.io/name: {{ include "statestore-async.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every resource, without app.kubernetes.io/component. */}}
{{- define "statestore-async.commonLabels" -}}
helm.sh/chart: {{ include "statestore-async.chart" . }}
{{ include "statestore-async.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector of the daemon pods (the component keeps the test pod out of it: a DaemonSet adopts
     orphan pods its selector matches). */}}
{{- define "statestore-async.daemonSelectorLabels" -}}
{{ include "statestore-async.selectorLabels" . }}
app.kubernetes.io/component: daemon
{{- end }}

{{/* Labels of the daemon's resources. */}}
{{- define "statestore-async.labels" -}}
{{ include "statestore-async.commonLabels" . }}
app.kubernetes.io/component: daemon
{{- end }}

{{- define "statestore-async.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "statestore-async.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "statestore-async.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The socket directory: hostDir without a trailing slash; the same path inside every pod. */}}
{{- define "statestore-async.socketDir" -}}
{{- $d := trimSuffix "/" .Values.socket.hostDir }}
{{- if not (hasPrefix "/" $d) }}
{{- fail (printf "socket.hostDir must be an absolute path, got %q" .Values.socket.hostDir) }}
{{- end }}
{{- $d }}
{{- end }}

{{/* The socket path: socket.hostDir + "/" + socket.name. */}}
{{- define "statestore-async.socketPath" -}}
{{- if contains "/" .Values.socket.name }}
{{- fail (printf "socket.name is a file name without '/', got %q" .Values.socket.name) }}
{{- end }}
{{- printf "%s/%s" (include "statestore-async.socketDir" .) .Values.socket.name }}
{{- end }}

{{- define "statestore-async.configDir" -}}
/etc/statestore-async
{{- end }}

{{- define "statestore-async.configPath" -}}
{{- printf "%s/statestore.toml" (include "statestore-async.configDir" .) }}
{{- end }}

{{/* objectStore.root, checked (the schema checks it too; this gives the message without it). */}}
{{- define "statestore-async.root" -}}
{{- $root := required "objectStore.root is required: s3://bucket[/prefix] or file:///path" .Values.objectStore.root }}
{{- if not (regexMatch "^(s3://[^/]+(/.*)?|file:///.+)$" $root) }}
{{- fail (printf "objectStore.root must look like s3://bucket[/prefix] or file:///path, got %q" $root) }}
{{- end }}
{{- $root }}
{{- end }}

{{/* A TOML value for a size: an integer as a bare number, a string like "2GiB" quoted. */}}
{{- define "statestore-async.tomlSize" -}}
{{- if kindIs "string" . }}{{ toJson . }}{{ else }}{{ int64 . }}{{ end }}
{{- end }}

{{/* Uids allowed on the socket: the daemon's own uid first, then socket.allowedUids. */}}
{{- define "statestore-async.allowedUids" -}}
{{- $uids := list (int64 .Values.podSecurityContext.runAsUser) }}
{{- range .Values.socket.allowedUids }}
{{- $uids = append $uids (int64 .) }}
{{- end }}
{{- $uids | uniq | join ", " }}
{{- end }}

{{/* Container securityContext of the daemon and of the test pod. */}}
{{- define "statestore-async.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ int64 .Values.podSecurityContext.runAsUser }}
runAsGroup: {{ int64 .Values.podSecurityContext.runAsGroup }}
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The hostPath volume of the socket directory (never the socket file). */}}
{{- define "statestore-async.socketVolume" -}}
- name: socket-dir
  hostPath:
    path: {{ include "statestore-async.socketDir" . }}
    type: DirectoryOrCreate
{{- end }}

{{/* Scheduling shared by the daemon and the test pod (the test must land on a daemon node). */}}
{{- define "statestore-async.scheduling" -}}
{{- $s := dict }}
{{- with .Values.nodeSelector }}{{ $_ := set $s "nodeSelector" . }}{{ end }}
{{- with .Values.affinity }}{{ $_ := set $s "affinity" . }}{{ end }}
{{- with .Values.tolerations }}{{ $_ := set $s "tolerations" . }}{{ end }}
{{- with $s }}{{ toYaml . }}{{ end }}
{{- end }}

{{/*
Env the daemon and the `helm test` pod share: where the config is, and S3 credentials from the
existing Secret when one is named (otherwise the AWS chain: IRSA / workload identity).
*/}}
{{- define "statestore-async.daemonEnv" -}}
- name: STATESTORE_CONFIG
  value: {{ include "statestore-async.configPath" . | quote }}
{{- with .Values.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.s3.secretAccessKeyKey }}
{{- if $.Values.s3.sessionTokenKey }}
- name: AWS_SESSION_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.s3.sessionTokenKey }}
{{- end }}
{{- end }}
{{- end }}
