{{/* Labels every object carries. */}}
{{- define "wasmcsi.labels" -}}
app.kubernetes.io/name: wasmcsi
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: wasmcsi
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "controller"). */}}
{{- define "wasmcsi.selector" -}}
app.kubernetes.io/name: wasmcsi
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "wasmcsi.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "wasmcsi.sidecarImage" -}}
{{ .repository }}:{{ .tag }}
{{- end -}}

{{- define "wasmcsi.priorityClassName" -}}
{{ .Values.priorityClass.name }}
{{- end -}}

{{/* The plugin dir kubelet dials, and the path of its socket as kubelet sees it. */}}
{{- define "wasmcsi.pluginDir" -}}
{{ .Values.kubeletDir }}/plugins/{{ .Values.driverName }}
{{- end -}}

{{/* A TOML value from a values.yaml value: YAML numbers reach templates as floats, and an
     integral one must stay an integer for the host's config parser. */}}
{{- define "wasmcsi.tomlValue" -}}
{{- $v := . -}}
{{- if kindIs "map" $v -}}
{ {{- $first := true -}}
{{- range $k, $x := $v -}}
{{- if $first }} {{ else }}, {{ end }}{{ $first = false }}{{ include "wasmcsi.tomlKey" $k }} = {{ include "wasmcsi.tomlValue" $x }}
{{- end }} }
{{- else if kindIs "slice" $v -}}
[{{- range $i, $x := $v -}}{{ if $i }}, {{ end }}{{ include "wasmcsi.tomlValue" $x }}{{- end -}}]
{{- else if kindIs "string" $v -}}
{{ $v | toJson }}
{{- else if kindIs "bool" $v -}}
{{ $v }}
{{- else if or (kindIs "float64" $v) (kindIs "float32" $v) -}}
{{- if eq $v (float64 (int64 $v)) }}{{ int64 $v }}{{ else }}{{ $v }}{{ end -}}
{{- else if kindIs "invalid" $v -}}
{{ fail "config.toml: a value is null (TOML has no null)" }}
{{- else -}}
{{ $v }}
{{- end -}}
{{- end -}}

{{- define "wasmcsi.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ . | toJson }}{{ end -}}
{{- end -}}

{{/* config.toml: [runtime] from .Values.limits, [backends.NAME] (+ .grants) from
     .Values.backends, [clusters.NAME] from .Values.clusters. */}}
{{- define "wasmcsi.configToml" -}}
[runtime]
{{- range $k, $v := .Values.limits }}
{{ include "wasmcsi.tomlKey" $k }} = {{ include "wasmcsi.tomlValue" $v }}
{{- end }}
{{- range $name, $b := .Values.backends }}

[backends.{{ include "wasmcsi.tomlKey" $name }}]
{{- range $k, $v := omit $b "grants" }}
{{ include "wasmcsi.tomlKey" $k }} = {{ include "wasmcsi.tomlValue" $v }}
{{- end }}
[backends.{{ include "wasmcsi.tomlKey" $name }}.grants]
{{- range $k, $v := $b.grants }}
{{ include "wasmcsi.tomlKey" $k }} = {{ include "wasmcsi.tomlValue" $v }}
{{- end }}
{{- end }}
{{- range $name, $c := .Values.clusters }}

[clusters.{{ include "wasmcsi.tomlKey" $name }}]
{{- range $k, $v := $c }}
{{ include "wasmcsi.tomlKey" $k }} = {{ include "wasmcsi.tomlValue" $v }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The environment both serve and `backend ls` read (so `kubectl exec … wasmcsi backend ls`
     sees what the server sees), and the pod's IP the endpoints listen on. */}}
{{- define "wasmcsi.env" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: WASMCSI_CONFIG
  value: /etc/wasmcsi/config.toml
- name: WASMCSI_BACKENDS_DIR
  value: /var/lib/wasmcsi/backends
- name: RUST_LOG
  value: {{ .Values.log.level | quote }}
{{- end -}}

{{/* The init container that fills the backends dir with the components in the image's
     /usr/share/wasmcsi/backends (the bundled ones, written there by `wasmcsi backend export`,
     and whatever a derived image adds). */}}
{{- define "wasmcsi.installBackends" -}}
- name: install-backends
  image: {{ include "wasmcsi.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["cp", "-a", "/usr/share/wasmcsi/backends/.", "/var/lib/wasmcsi/backends/"]
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: ["ALL"]
    seccompProfile:
      type: RuntimeDefault
  volumeMounts:
    - name: backends-dir
      mountPath: /var/lib/wasmcsi/backends
{{- end -}}

{{/* Leaves this image's binary in the data path's binary directory, for a live upgrade of the
data path (`wasmcsi upgrade datapath`). Copied beside, then renamed: the data path may be running
an older copy of the same name. */}}
{{- define "wasmcsi.stageBinary" -}}
- name: stage-binary
  image: {{ include "wasmcsi.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - sh
    - -c
    - cp /usr/bin/wasmcsi {{ .Values.datapath.binDir }}/.wasmcsi-{{ .Chart.AppVersion }}.tmp && mv -f {{ .Values.datapath.binDir }}/.wasmcsi-{{ .Chart.AppVersion }}.tmp {{ .Values.datapath.binDir }}/wasmcsi-{{ .Chart.AppVersion }}
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: ["ALL"]
    seccompProfile:
      type: RuntimeDefault
  volumeMounts:
    - name: datapath-bin
      mountPath: {{ .Values.datapath.binDir }}
{{- end -}}

{{/* securityContext of an unprivileged sidecar. */}}
{{- define "wasmcsi.sidecarSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The volume `tls` of this node's credentials, for the node plugin and the data path: the
host directory node.tlsDir (builtin: the node plugin enrolls into it, the data path reads it),
or the operator's volume (tls.operator.nodeVolume). */}}
{{- define "wasmcsi.nodeTlsVolume" -}}
{{- if eq .Values.tls.issuer "builtin" -}}
- name: tls
  hostPath:
    path: {{ .Values.node.tlsDir }}
    type: DirectoryOrCreate
{{- else if eq .Values.tls.issuer "operator" -}}
{{- if not .Values.tls.operator.nodeVolume }}
{{- fail "tls.issuer operator: tls.operator.nodeVolume must give the node credentials' volume" }}
{{- end }}
- name: tls
  {{- toYaml .Values.tls.operator.nodeVolume | nindent 2 }}
{{- else -}}
{{- fail "tls.issuer: builtin or operator" }}
{{- end -}}
{{- end -}}

{{/* Sources of the driver's own traffic: its pods, and the nodes' ranges (the hostNetwork
pods' connections come from node addresses, which no pod selector matches). Without ranges,
the port is open to any source and mutual TLS decides. */}}
{{- define "wasmcsi.driverSources" -}}
{{- if .Values.networkPolicy.nodeCIDRs }}
from:
  - podSelector:
      matchLabels:
        app.kubernetes.io/name: wasmcsi
        app.kubernetes.io/instance: {{ .Release.Name }}
  {{- range .Values.networkPolicy.nodeCIDRs }}
  - ipBlock:
      cidr: {{ . }}
  {{- end }}
{{- end }}
{{- end }}
{{- define "wasmcsi.metricsSources" -}}
from:
  - namespaceSelector:
      matchLabels:
        kubernetes.io/metadata.name: {{ .Values.networkPolicy.metricsNamespace }}
{{- end }}
