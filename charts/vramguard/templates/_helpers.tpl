{{/*
Names are fixed (vramguard-*): the webhook configuration, the ClusterRoles and the scheduler name
are cluster-wide, so one release per cluster; the release namespace is where everything runs.
*/}}
{{- define "vramguard.labels" -}}
app.kubernetes.io/name: vramguard
app.kubernetes.io/part-of: vramguard
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "vramguard.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "vramguard.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "vramguard.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "vramguard.policy" -}}
{{- $scaleUp := .Values.scaleUp.autoscaler -}}
{{- if not (has $scaleUp (list "none" "cluster-autoscaler" "karpenter")) }}{{ fail "scaleUp.autoscaler must be none, cluster-autoscaler or karpenter" }}{{ end -}}
{{- if .Values.policy }}
{{- if and (ne $scaleUp "none") (not (contains "scale_up:" .Values.policy)) }}{{ fail "scaleUp.autoscaler is set: give your policy a scale_up section with the same autoscaler (docs/autoscaling.md)" }}{{ end -}}
{{ .Values.policy }}
{{- else if eq .Values.mode "default-scheduler" }}{{ .Files.Get "files/policy.yaml" | replace "\nschedulers: [vramguard]\n" "\nschedulers: [default-scheduler]\n" }}
{{- else }}{{ .Files.Get "files/policy.yaml" }}{{ end -}}
{{- if and (not .Values.policy) (ne $scaleUp "none") }}
scale_up:
  autoscaler: {{ $scaleUp }}
{{- end -}}
{{- end -}}

{{- define "vramguard.extenderContainer" -}}
- name: extender
  image: {{ include "vramguard.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - extender
    {{- if eq .Values.mode "second-scheduler" }}
    # Loopback only: kube-scheduler runs in the same pod.
    - --listen=127.0.0.1:{{ .Values.extender.port }}
    {{- else }}
    - --listen=0.0.0.0:{{ .Values.extender.port }}
    {{- end }}
    - --tls-cert=/etc/vramguard/tls/tls.crt
    - --tls-key=/etc/vramguard/tls/tls.key
    - --client-ca=/etc/vramguard/tls/ca.crt
    - --ops-listen=0.0.0.0:{{ .Values.extender.opsPort }}
    - --policy=/etc/vramguard/policy/policy.yaml
    - --agent-namespace={{ .Release.Namespace }}
    {{- if eq .Values.mode "second-scheduler" }}
    # kube-scheduler's own leader election picks the one sidecar that is called (docs/operations.md, "High availability and leader election").
    - --leader-elect=false
    # Preemption, learning and Events run only in the leading scheduler's sidecar.
    - --scheduler-lease={{ .Release.Namespace }}/vramguard-scheduler
    {{- else }}
    - --leader-elect=true
    - --leader-elect-resource-name=vramguard-extender
    - --drain-delay=5
    {{- end }}
  ports:
    {{- if ne .Values.mode "second-scheduler" }}
    - name: https
      containerPort: {{ .Values.extender.port }}
    {{- end }}
    - name: ops
      containerPort: {{ .Values.extender.opsPort }}
  readinessProbe:
    httpGet: {path: /readyz, port: ops, scheme: HTTP}
    periodSeconds: 5
  livenessProbe:
    httpGet: {path: /healthz, port: ops, scheme: HTTP}
    periodSeconds: 10
    failureThreshold: 6
  resources:
    {{- toYaml .Values.extender.resources | nindent 4 }}
  securityContext:
    {{- include "vramguard.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - {name: extender-tls, mountPath: /etc/vramguard/tls, readOnly: true}
    - {name: policy, mountPath: /etc/vramguard/policy, readOnly: true}
    - {name: tmp, mountPath: /tmp}
{{- end -}}

{{/* kube-scheduler's image tag: scheduler.image.tag, else the cluster's version without a
provider suffix (v1.36.3-eks-1552ad0 -> v1.36.3). */}}
{{- define "vramguard.schedulerTag" -}}
{{- if .Values.scheduler.image.tag -}}
{{- .Values.scheduler.image.tag -}}
{{- else -}}
{{- regexFind "^v[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- end -}}
{{- end -}}
