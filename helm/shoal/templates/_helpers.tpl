{{/*
Names and labels shared by every template.
*/}}

{{/* The chart's name, or nameOverride. */}}
{{- define "shoal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object's name: fullnameOverride, else the release name when it already holds
the chart's name, else "<release>-<chart>". Cut to 63 characters (the DNS label limit).
*/}}
{{- define "shoal.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "shoal.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The operator's Deployment, ServiceAccount and RBAC objects: "<fullname>-operator". */}}
{{- define "shoal.operatorName" -}}
{{- printf "%s-operator" (include "shoal.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{- define "shoal.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* What selects the operator's pods; never changes across upgrades. */}}
{{- define "shoal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The standard labels of every object the chart creates. */}}
{{- define "shoal.labels" -}}
helm.sh/chart: {{ include "shoal.chart" . }}
{{ include "shoal.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: shoal
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "shoal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "shoal.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image repository, required: no registry publishes shoal's image, so an install names the one
the user built and pushed (or loaded into the nodes) instead of a default that pulls nothing.
*/}}
{{- define "shoal.imageRepository" -}}
{{- required "image.repository is required: no registry publishes shoal's image. Build it (make image), push it to a registry your nodes pull from or load it into them (kind load docker-image), then install with --set image.repository=REGISTRY/shoal --set image.tag=TAG (README, On Kubernetes)" .Values.image.repository }}
{{- end }}

{{/* The operator's image: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "shoal.image" -}}
{{- printf "%s:%s" (include "shoal.imageRepository" .) (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The engine image of ModelDeployments without spec.image: operator.engineImage, else the image
repository at the chart's appVersion. It does not follow image.tag, so a new operator tag rolls the
operator alone; a new chart version (a new appVersion) rolls unpinned engines too.
*/}}
{{- define "shoal.engineImage" -}}
{{- default (printf "%s:%s" (include "shoal.imageRepository" .) .Chart.AppVersion) .Values.operator.engineImage }}
{{- end }}

{{/*
What the operator may do, the same rules for its ClusterRole or for each watched namespace's Role:
exactly the calls it makes (its Kubernetes API module and kopf's bookkeeping), nothing else.
*/}}
{{- define "shoal.operatorRules" -}}
- apiGroups: [shoal.dev]
  resources: [modeldeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [shoal.dev]
  resources: [modeldeployments/status]
  verbs: [update]
- apiGroups: [shoal.dev]
  resources: [modeldeployments/scale]
  verbs: [patch]
- apiGroups: [shoal.dev]
  resources: [modeldeployments/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [list, create, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, create, patch, delete]
{{- end }}
